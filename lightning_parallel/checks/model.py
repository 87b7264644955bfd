"""Model checks: can the model be split as asked (TP divisibility, a plan that names modules, enough
pipeline blocks, blocks and ``sdpa`` attention to split the sequence over), and does it train in a way
the pipeline can run. Pure; work on a meta-device model."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

from torch import nn

from lightning_parallel.errors import ConfigurationError, Fix, LaunchError
from lightning_parallel.expert_parallel.placement import (
    expert_count,
    find_experts,
    owned_experts,
)
from lightning_parallel.mesh import MeshError, ParallelMesh
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline.errors import (
    PipelineConfigError,
    PipelineIncompatibleModel,
)
from lightning_parallel.pipeline.partition import (
    StagePlan,
    block_lists,
    find_blocks,
    plan_stages,
)
from lightning_parallel.pipeline.schedules import placement_of
from lightning_parallel.tensor_parallel.detect import detect_plan
from lightning_parallel.tensor_parallel.plan import Plan, TensorParallelError, parse_plan
from lightning_parallel.tensor_parallel.resolve import (
    Assignment,
    divisors,
    resolve_plan,
)


def check_model(model: nn.Module, mesh: ParallelMesh,
                options: ParallelOptions) -> tuple[list[Assignment], StagePlan | None]:
    """The TP assignments and pipeline stages of ``model`` on ``mesh`` with ``options`` (its TP plan,
    sequence parallelism, pipeline blocks and layout, stages placed as its schedule runs them, see
    ``pipeline.schedules.placement``); refuses sizes the model does not divide, with the sizes that would
    work (or, for a block list it does not find, the model's own lists that would) as fixes. Works on a
    model built on the meta device."""
    tp_plan, sequence_parallel, pipeline_blocks = options.tp_plan, options.sequence_parallel, options.pipeline_blocks
    virtual_stages, pipeline_layout = options.chunks, options.pipeline_layout
    if mesh.cp_size > 1:
        check_context_parallel(model, options)
    if mesh.ep_size > 1:
        check_expert_parallel(model, mesh.ep_size, mesh.dp_size)
    assignments: list[Assignment] = []
    if mesh.tp_size > 1:
        try:
            assignments = tp_assignments(model, mesh.tp_size, tp_plan, sequence_parallel)
        except TensorParallelError as err:
            raise _tp_refusal(model, mesh, options, err) from None
        if tp_plan is None:  # a plan the user gave is used as given
            # imported here: the share counts stages with the planner's estimate, and the planner checks models here
            from lightning_parallel.checks.share import refuse_nothing_worth_splitting

            refuse_nothing_worth_splitting(model, assignments, mesh.tp_size)

    def stages(blocks: str | None) -> StagePlan:
        return plan_stages(model, mesh.pp_size, virtual_stages, blocks, pipeline_layout,
                           placement=placement_of(options.schedule_name))

    try:
        blocks = len(find_blocks(model, pipeline_blocks)[1])
    except (PipelineIncompatibleModel, PipelineConfigError) as err:
        if mesh.pp_size == 1:
            return assignments, None
        fixes = [Fix({"strategy.pipeline_blocks": path}) for path in block_lists(model, pipeline_blocks)
                 if _splits(stages, path)][:3]
        fixes.append(Fix({"strategy.pipeline_parallel": 1}, "train without pipelining"))
        lead = "block lists of this model that split into the stages, or train without pipelining:"
        raise LaunchError(f"{err}; {lead if len(fixes) > 1 else 'or train without pipelining:'}", fixes) from None
    try:
        plan = stages(pipeline_blocks)
    except PipelineConfigError as err:
        if pipeline_layout is not None:  # the message already gives a layout that works
            raise LaunchError(str(err)) from None
        fits = [p for p in divisors(mesh.world_size // mesh.tp_size) if p * virtual_stages <= blocks]
        if fits and max(fits) > 1:
            raise MeshError(f"{err}. Pipeline sizes that fit the model and the world: {fits}, e.g.",
                              [Fix({"strategy.pipeline_parallel": max(fits), "strategy.data_parallel": "auto"})]
                              ) from None
        raise MeshError(f"{err}; or train without pipelining:", [Fix({"strategy.pipeline_parallel": 1})]) from None
    return assignments, plan


def check_context_parallel(model: nn.Module, options: ParallelOptions) -> None:
    """Refuse, before any process starts, what context parallelism visibly cannot split: no block list
    to split the sequence at, Hugging Face attention other than ``sdpa`` (it would not go round the
    ring), torch attention layers that are not batch first. What shows only when the model runs is
    checked in the first step (``checks/first_step.py``)."""
    cp = options.cp
    try:
        find_blocks(model, options.pipeline_blocks)
    except (PipelineIncompatibleModel, PipelineConfigError) as err:
        fixes = [Fix({"strategy.pipeline_blocks": path}) for path in block_lists(model, options.pipeline_blocks)][:3]
        raise LaunchError(f"context_parallel={cp} splits the sequence at the model's first block and gathers it after "
                          f"the last: {err}; name the block list, or train without context_parallel:",
                          [*fixes, Fix({"strategy.context_parallel": 1})]) from None
    for name, module in model.named_modules():
        attention = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if attention is not None and attention != "sdpa":
            raise LaunchError(
                f"context_parallel={cp}: {name or type(model).__name__} computes attention with "
                f"attn_implementation={attention!r}, which context parallelism cannot split: only "
                "torch.nn.functional.scaled_dot_product_attention goes round the ring of ranks. Load or build the "
                "model with attn_implementation='sdpa' (from_pretrained(..., attn_implementation='sdpa'), or "
                "config._attn_implementation = 'sdpa'), or train without context_parallel:",
                [Fix({"strategy.context_parallel": 1})])
        if isinstance(module, nn.MultiheadAttention) and not module.batch_first:
            raise LaunchError(
                f"context_parallel={cp}: {name} is an nn.MultiheadAttention with batch_first=False; context "
                "parallelism splits dimension 1 of the blocks' hidden state as the sequence. Build the layers with "
                "batch_first=True, or train without context_parallel:", [Fix({"strategy.context_parallel": 1})])


def _splits(stages, blocks: str) -> bool:
    """Whether ``stages(blocks)`` plans a pipeline with ``blocks`` as the block list."""
    try:
        stages(blocks)
    except (PipelineIncompatibleModel, PipelineConfigError):
        return False
    return True


def tp_assignments(model: nn.Module, tp: int, tp_plan: Mapping | None, sequence_parallel: bool) -> list[Assignment]:
    """The modules ``tp_plan`` (None: the detected plan) splits over ``tp`` ranks, each with its entry."""
    plan = parse_plan(tp_plan) if tp_plan is not None else _detected_plan(model, sequence_parallel)
    return resolve_plan(model, plan, tp, sequence_parallel)


# model -> (its modules and parameter shapes, sequence_parallel) and the plan detected for them
_DETECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _detected_plan(model: nn.Module, sequence_parallel: bool) -> Plan:
    """``detect_plan``, once while the model's modules and parameter shapes stay the same: detection reads
    every module and does not depend on the TP size, which a refusal and the planner try many of."""
    key = (tuple((n, id(m)) for n, m in model.named_modules()),
           tuple((n, tuple(p.shape)) for n, p in model.named_parameters()), sequence_parallel)
    cached = _DETECTED.get(model)
    if cached is None or cached[0] != key:
        cached = _DETECTED[model] = (key, detect_plan(model, sequence_parallel))
    return cached[1]


def _tp_fits(model: nn.Module, tp: int, tp_plan: Mapping | None, sequence_parallel: bool) -> bool:
    try:
        tp_assignments(model, tp, tp_plan, sequence_parallel)
    except TensorParallelError:
        return False
    return True


def head_counts(model: nn.Module) -> list[tuple[int, str]]:
    """The counts a TP size must divide that the model states itself, each with the module that states it:
    a Hugging Face config's attention and KV heads, an ``nn.MultiheadAttention``'s heads
    (``[(4, "attention heads of BertForSequenceClassification")]``)."""
    counts: dict[str, tuple[int, str]] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "base_model_prefix") and config is not None:
            for attr, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads")):
                if isinstance(getattr(config, attr, None), int):
                    counts.setdefault(what, (getattr(config, attr), type(module).__name__))
        elif isinstance(module, nn.MultiheadAttention):
            counts.setdefault("attention heads", (module.num_heads, type(module).__name__))
    if "KV heads" in counts and counts["KV heads"][0] == counts.get("attention heads", (0,))[0]:
        del counts["KV heads"]
    return [(n, f"{what} of {owner}") for what, (n, owner) in counts.items()]


def _tp_refusal(model: nn.Module, mesh: ParallelMesh, options: ParallelOptions, err: TensorParallelError) -> LaunchError:
    """A TP size the model does not split into, in the model's own terms where it states them ("4 attention
    heads", not the width of a Linear), with the TP sizes it allows and the largest of them the world fits."""
    tp, plan, sequence_parallel = mesh.tp_size, options.tp_plan, options.sequence_parallel
    counts = head_counts(model)
    # KV heads fewer than the TP ranks are copied (tensor_parallel/kv_heads.py): a multiple of them fits too
    fits_kv = lambda n, what, t: what.startswith("KV") and t % n == 0  # noqa: E731
    undivided = [(n, what) for n, what in counts if n % tp and not fits_kv(n, what, tp)]
    # the sizes that split the model: divisors of its heads where it states them, else of the world
    candidates = ([t for t in divisors(max(n for n, _ in counts))
                   if all(n % t == 0 or fits_kv(n, what, t) for n, what in counts)]
                  if counts else [t for t in divisors(mesh.world_size) if t < tp])
    allowed = [t for t in candidates if t == 1 and plan is None or _tp_fits(model, t, plan, sequence_parallel)]
    if not allowed:  # a plan that fits no size (a glob that names no module, an unknown style) has its own fix
        return LaunchError(str(err))
    if undivided:
        n, what = undivided[0]
        copied = " (or, for KV heads, a multiple of them: each rank then copies one)" if what.startswith("KV") else ""
        problem = (f"tensor_parallel={tp} does not divide the {n} {what}{copied}: each TP rank computes whole heads. "
                   f"TP sizes this model allows: {allowed}")
    else:
        problem = f"{err}\nTP sizes this model and world allow: {allowed}"
    fits = [t for t in allowed if t < tp and mesh.world_size % t == 0]
    fix = (Fix({"strategy.tensor_parallel": 1}, "data parallelism only") if fits == [1] else
           Fix({"strategy.tensor_parallel": max(fits), "strategy.data_parallel": "auto"}) if fits else None)
    return MeshError(problem + (", e.g." if fix else ""), [fix] if fix else [])


def check_training_mode(model: nn.Module, pipeline_parallel: int, automatic_optimization: bool,
                        loss_scaler: bool) -> None:
    """Refuse what the pipeline cannot run: it calls forward and backward of every micro-batch
    itself, inside ``training_step``, and scales no loss."""
    if pipeline_parallel == 1:
        return
    name = type(model).__name__
    if not automatic_optimization:
        raise LaunchError(
            f"{name} sets automatic_optimization = False, which pipeline_parallel={pipeline_parallel} does not "
            "support: the pipeline runs forward and backward of every micro-batch itself, inside training_step, "
            "so manual_backward and optimizer.step() calls there have no gradients to act on. Return the loss "
            "from training_step and let Lightning optimise (automatic_optimization = True), or train without "
            "pipelining (data and tensor parallelism support manual optimisation):",
            [Fix({"strategy.pipeline_parallel": 1})],
        )
    if loss_scaler:
        raise LaunchError(
            f"{name}: precision '16-mixed' needs a loss scaler, which pipeline_parallel={pipeline_parallel} does "
            "not apply; train in bfloat16 or float32:",
            [Fix({"trainer.precision": "bf16-mixed"})],
        )


def check_expert_parallel(model: nn.Module, ep: int, dp: int) -> None:
    """Refuse a model without routed experts, or whose expert count ``ep`` does not divide (every
    rank holds the same number of whole experts), before any process group exists; the fix is the
    largest smaller size that divides both the experts and the ``dp`` data-parallel ranks."""
    found = find_experts(model)
    if not found:
        raise LaunchError(
            f"expert_parallel={ep}, but the model has no Mixture-of-Experts layer whose experts are one module with "
            "3-D parameters called as experts(hidden_states, top_k_index, top_k_weights) (Hugging Face Mixtral, "
            "Qwen-MoE, DeepSeek-V3, OLMoE ...):", [Fix({"strategy.expert_parallel": 1})])
    for name, experts in found.items():
        count = expert_count(name, experts)
        try:
            owned_experts(count, ep, 0)
        except ConfigurationError as err:
            best = max(e for e in range(1, ep) if count % e == 0 and dp % e == 0)
            raise LaunchError(f"{name}: {err}, e.g.", [Fix({"strategy.expert_parallel": best})]) from None

"""Build a model without memory, and remember how its construction set every parameter.

Inside ``empty_parameters()`` (``trainer.init_module(empty_init=True)`` with our strategies, and
``configure_model`` under it) every parameter a module creates lives on the meta device, while
buffers, metric states and other tensors stay real (causal masks and rotary tables keep the
values their constructor computed). Nothing that construction does to a parameter is lost: it is
recorded on the parameter as a ``History``, which ``materialize.py`` replays later, once the
model is split, for exactly the part a rank holds:

- ``initial``: the value the parameter was given. None for a fresh one (``torch.empty``, a meta
  tensor); a real tensor that was passed in (``nn.Parameter(loaded)``, ``load_state_dict``,
  ``param.copy_(t)``, ``param.data = t``: kept by reference until materialisation, so a module
  that loads a state dict in ``__init__`` holds it in host memory until setup); or a lazy source
  such as a tensor in a safetensors file (``checkpoint/pretrained.py`` defers Hugging Face
  ``from_pretrained`` reads this way, so each rank reads only its own slices);
- ``ops``: every in-place operation applied afterwards to the parameter or to a view of it, in
  order: ``nn.init`` functions, ``normal_``, ``mul_``, ``weight[padding_idx].fill_(0)``,
  ``param.data = param.to(dtype)``. They are replayed on the real tensor with the module's seeded
  generator, which is how torch layers that initialise in a private method
  (``nn.MultiheadAttention._reset_parameters``), loops in a parent's ``__init__`` (nanoGPT's scaled
  ``c_proj``) and PEFT's LoRA initialisation all get their values;
- ``unknown``: why construction did something that cannot be replayed (a parameter filled from
  a meta tensor whose value nothing records). Materialising it is refused with that reason; nothing
  is initialised over it.

Construction that reads a parameter's values (``resize_token_embeddings``, which draws the new rows
from the old rows' mean and covariance; an init that scales one weight by another's ``std()``;
``buffer.copy_(param)``) gets them on demand: the parameter's value is computed on the host from its
record (read from the pretrained file, the recorded calls replayed) and the call runs on real
tensors, as in eager construction; what it writes into a parameter is recorded like any other
value. Only the parameters read are built on the host, and only until the model is split. A read of
a value that is not known before materialisation (a parameter made on the meta device by the module
itself, which draws its values only then; one nothing set) is refused at construction with
``MetaConstructionError``, naming the call. Modules created with ``device=param.device`` get the
device eager construction would have given them (the host), so their own random initialisation draws
from the generator as there.

Calls after construction (a model's init functions applied to the built model) are recorded the same
way inside ``recording(model)``; ``reset_recorded(model)`` calls every module's ``reset_parameters()``
so, as FSDP does with a model built on meta.

Recording is done by a ``TorchFunctionMode`` that sees every torch call during construction and
by the constructors of ``nn.Parameter`` and ``nn.Module.register_parameter``; only calls that
touch a recorded parameter are handled, everything else runs as usual.
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_parallel.checkpoint.pretrained import SafetensorsTensor, deferred_pretrained_reads
from lightning_parallel.errors import MetaConstructionError

# nn.init functions that reach a TorchFunctionMode themselves (the others reach it through the
# tensor methods they call, e.g. xavier_uniform_ -> uniform_): recorded as one call
_INIT_FUNCTIONS = {f for name, f in vars(nn.init).items() if callable(f) and name.endswith("_")}
# calls that return a view of their first argument: a write into the view writes the parameter
_VIEWS = {
    Tensor.__getitem__, Tensor.view, Tensor.view_as, Tensor.reshape, Tensor.t, Tensor.transpose,
    Tensor.permute, Tensor.narrow, Tensor.select, Tensor.squeeze, Tensor.unsqueeze, Tensor.flatten,
    Tensor.unflatten, Tensor.diagonal, Tensor.expand, Tensor.as_strided, Tensor.movedim,
    Tensor.chunk, Tensor.split, Tensor.unbind, Tensor.tensor_split,
}
_ALIASES = {Tensor.data.__get__, Tensor.detach}  # the parameter itself, without autograd
_COPIES = {Tensor.clone, Tensor.to, Tensor.type, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16,
           Tensor.contiguous}  # a copy of the whole parameter, possibly in another dtype
# a new method-wrapper at each access: compared with ==
_SET_DATA = Tensor.data.__set__
_DEVICE = Tensor.device.__get__
_IS_META = Tensor.is_meta.__get__
_EMPTY = {torch.empty, torch.empty_like, torch.empty_strided, Tensor.new_empty}
# calls that draw random numbers (nn.init functions and tensor methods)
_RANDOM = {"normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
           "trunc_normal_", "orthogonal_", "sparse_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
           "cauchy_", "random_"}
# in-place methods that change no values
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad", "record_stream", "pin_memory"}
# calls that make a new tensor shaped like a parameter without reading its values
_SHAPED_LIKE = {torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
                torch.randint_like, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, Tensor.new_tensor}


def _writes(func: Callable) -> bool:
    if func in _INIT_FUNCTIONS or func is Tensor.__setitem__:
        return True
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


@dataclass
class Op:
    """One in-place call on ``view``, the tensor reached from the parameter through ``path`` (view
    calls ``(func, args, kwargs, index into a tuple result)``): ``func(view, *args, **kwargs)``, or
    ``func(*args, **{slot: view}, **kwargs)`` where the call named its target (``init.normal_(tensor=w)``)."""

    path: tuple
    func: Callable
    args: tuple
    kwargs: dict
    slot: Optional[str] = None
    rng: Optional[Tensor] = None  # the generator's state when construction made this random call

    def apply(self, tensor: Tensor) -> Tensor:
        """Apply to the real ``tensor``; returns it (a dtype change returns a new tensor). A random call
        draws from the generator state construction had, so it gives the values eager construction gave."""
        if self.func == _SET_DATA:  # param.data = param.to(dtype): the only whole-tensor replacement kept
            return tensor.to(self.args[0])
        view = _follow(tensor, self.path)
        if self.rng is None:
            self.call(view)
            return tensor
        kwargs = self.kwargs
        if isinstance(kwargs.get("generator"), torch.Generator):  # a generator of the model's own: same state
            kwargs = {**kwargs, "generator": torch.Generator(kwargs["generator"].device).set_state(self.rng)}
            self.call(view, kwargs)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self.rng)
                self.call(view)
        return tensor

    def call(self, view: Tensor, kwargs: Optional[dict] = None) -> None:
        kwargs = self.kwargs if kwargs is None else kwargs
        if self.slot is None:
            self.func(view, *self.args, **kwargs)
        else:
            self.func(*self.args, **{self.slot: view}, **kwargs)


def _split_target(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict, Optional[str]]:
    """(target, other positional args, other keyword args, keyword naming the target or None)."""
    if args:
        return args[0], args[1:], kwargs, None
    for key, value in kwargs.items():
        if isinstance(value, Tensor):
            return value, (), {k: v for k, v in kwargs.items() if k != key}, key
    return None, (), kwargs, None


@dataclass
class History:
    """How construction set one parameter (see the module docstring)."""

    initial: Any = None
    ops: list[Op] = field(default_factory=list)
    unknown: Optional[str] = None
    dtype: Optional[torch.dtype] = None  # the dtype the parameter was created in (ops replay in it)
    device: str = "cpu"  # where eager construction would have put it: random calls draw only off "meta"

    value: Optional[Tensor] = field(default=None, repr=False)  # the value computed for a read, until a write

    def reset(self, initial: Any) -> None:
        """A value assigned whole: what came before no longer matters."""
        self.initial, self.ops, self.unknown, self.value = initial, [], None, None
        self.dtype = getattr(initial, "dtype", self.dtype)

    def add(self, op: Op) -> None:
        self.ops.append(op)
        self.value = None

    def copy(self) -> "History":
        return History(self.initial, list(self.ops), self.unknown, self.dtype, self.device)

    def not_known_yet(self) -> Optional[str]:
        """Why the value cannot be computed before materialisation (None: it can, by ``replay``)."""
        if self.unknown is not None:
            return f"during construction {self.unknown}"
        if self.initial is None and not self.ops:
            return "nothing has set its value yet"
        if any(op.rng is None and _name(op.func) in _RANDOM for op in self.ops):
            return ("it was made on the meta device, so its random initialisation draws only when the model is "
                    "materialised")
        return None

    def replay(self, like: Tensor, device: torch.device) -> Tensor:
        """The whole value: the initial value with the recorded calls applied, in ``like``'s shape and dtype."""
        initial = self.initial
        if isinstance(initial, SafetensorsTensor):
            value = initial.read().to(device)
        elif isinstance(initial, Tensor):
            value = initial.to(device=device, copy=True)
        else:
            value = unset(like, device, self.dtype)
        for op in self.ops:
            value = op.apply(value)
        return value.to(like.dtype)


def unset(like: Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A tensor shaped like ``like``, NaN where floating point, so a value no init function wrote is detected."""
    empty = torch.empty(like.shape, dtype=dtype or like.dtype, device=device)
    return empty.fill_(float("nan")) if empty.is_floating_point() else empty


def history_of(param: Tensor) -> Optional[History]:
    """The recorded history of a parameter created under ``empty_parameters()`` (None otherwise)."""
    return getattr(param, "_lp_history", None)


def _deepcopy_keeping_history(original: Callable) -> Callable:
    def deepcopy(self: nn.Parameter, memo: dict) -> nn.Parameter:
        result = original(self, memo)
        history = history_of(self)
        if history is not None and history_of(result) is None:
            result._lp_history = history.copy()
        return result

    deepcopy.__wrapped__ = original
    return deepcopy


# torch's Parameter.__deepcopy__ drops attributes; a deep copy of a model built on meta (an EMA copy,
# a test's reference copy) must keep how its parameters are to be set
if not hasattr(nn.Parameter.__deepcopy__, "__wrapped__"):
    nn.Parameter.__deepcopy__ = _deepcopy_keeping_history(nn.Parameter.__deepcopy__)


class _Recorder(TorchFunctionMode):
    """Records in-place calls on meta parameters (and their views) instead of running them on meta."""

    def __init__(self, draws: bool = True) -> None:
        super().__init__()
        self.draws = draws
        # id(tensor) -> (tensor, parameter, path): views and aliases of recorded parameters, and the
        # parameters themselves (path ()); the tensor is kept so an id is never reused meanwhile
        self.aliases: dict[int, tuple[Tensor, nn.Parameter, tuple]] = {}
        self.copies: dict[int, tuple[Tensor, nn.Parameter]] = {}  # whole copies (clone, to(dtype))
        # tensors made by torch.empty and friends (no values yet), and the device eager construction gives them
        self.empty: dict[int, tuple[weakref.ref, str]] = {}
        # id(device) -> (device, eager device type): the devices ``param.device`` returned
        self.devices: dict[int, tuple[torch.device, str]] = {}

    def track(self, param: nn.Parameter, history: History) -> nn.Parameter:
        if history.dtype is None:
            history.dtype = param.dtype
        param._lp_history = history
        self.aliases[id(param)] = (param, param, ())
        return param

    def alias(self, tensor: Any) -> Optional[tuple[nn.Parameter, tuple]]:
        entry = self.aliases.get(id(tensor)) if isinstance(tensor, Tensor) else None
        return (entry[1], entry[2]) if entry is not None and entry[0] is tensor else None

    def source_of(self, data: Tensor) -> History:
        """The history of a parameter created from ``data`` (a copy of another parameter's, where ``data``
        copies a parameter: ``copy.deepcopy`` of a layer, ``param.to(dtype)``)."""
        made = self.empty.pop(id(data), None)
        if made is not None and made[0]() is data:
            return History(device=made[1])
        copied = self.copy_of(data)
        if copied is not None:
            history = history_of(copied).copy()
            if data.dtype != copied.dtype:
                history.ops.append(Op((), _SET_DATA, (data.dtype,), {}))
            return history
        found = self.alias(data)
        if found is not None:
            if found[1] == ():
                return history_of(found[0]).copy()
            return History(unknown="it was created from a view of another parameter")
        if data.is_meta:  # made on the meta device by a factory: a fresh parameter
            return History(device="meta")
        return History(initial=data.detach(), device=data.device.type)

    def copy_of(self, tensor: Any) -> Optional[nn.Parameter]:
        entry = self.copies.get(id(tensor)) if isinstance(tensor, Tensor) else None
        return entry[1] if entry is not None and entry[0] is tensor else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _EMPTY:
            out = func(*args, **kwargs)
            self.empty[id(out)] = (weakref.ref(out), self.eager_device(kwargs.get("device")) or out.device.type)
            return out
        target, rest, others, slot = _split_target(args, kwargs)
        found = self.alias(target)
        if found is None:
            if self.copy_of(target) is not None and _writes(func):  # its values now differ from the parameter's
                self.copies.pop(id(target))
            elif any(self.alias(t) or self.copy_of(t) is not None for t in tree_flatten((args, kwargs))[0]):
                return self._read(func, args, kwargs)
            if self.devices and not any(isinstance(t, Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0]):
                args, kwargs = tree_map(self.on_eager_device, (args, kwargs))  # a meta tensor stays on meta
            return func(*args, **kwargs)
        param, path = found
        history = history_of(param)
        if func == _DEVICE:
            return self._device_of(history)
        if func == _IS_META and self.draws:  # init functions that skip meta tensors (trunc_normal_) run as on the host
            return history.device == "meta"
        if func in _ALIASES and len(args) == 1:
            out = func(*args, **kwargs)
            self.aliases[id(out)] = (out, param, path)
            return out
        if func in _VIEWS:
            out = func(*args, **kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for index, view in enumerate(outs):
                step = (func, args[1:], kwargs, index if isinstance(out, (tuple, list)) else None)
                self.aliases[id(view)] = (view, param, path + (step,))
            return out
        if func in _COPIES and path == ():
            out = func(*args, **kwargs)
            if isinstance(out, Tensor):
                self.copies[id(out)] = (out, param)
            return out
        if (func == _SET_DATA or func is Tensor.copy_) and rest:
            self._assign(history, param, path, rest[0], func)
            return None if func == _SET_DATA else target
        if _writes(func):
            given = tree_map(self._known_value, (rest, others))
            if any(isinstance(t, Tensor) and t.is_meta for t in tree_flatten(given)[0]):
                history.unknown = f"{_name(func)}(...) was given another meta tensor"
            else:
                history.add(self._drawn(Op(path, func, *given, slot), target, history.device))
            return target
        if _name(func) in _NOT_WRITES:
            return func(*args, **kwargs)
        return self._read(func, args, kwargs)

    # ---- values read during construction, and the device eager construction would have used ----
    def _read(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``func`` on recorded parameters: on meta where it needs no values (shapes, dtypes, a tensor shaped
        like one), otherwise on the parameters' values, computed now on the host (see the module docstring)."""
        if not _writes(func):  # a real tensor written from a parameter needs its value
            try:
                out = func(*args, **kwargs)
            except (RuntimeError, NotImplementedError):  # a value the meta device does not have (item, bool)
                pass
            else:
                if func in _SHAPED_LIKE or not any(isinstance(t, Tensor) for t in tree_flatten(out)[0]):
                    return out
        args, kwargs = tree_map(lambda t: self._value(t, func), (args, kwargs))
        return func(*args, **kwargs)

    def _value(self, tensor: Any, func: Callable) -> Any:
        """The host value of a recorded parameter, a view or a copy of one; anything else as it is."""
        found = self.alias(tensor)
        copied = None if found is not None else self.copy_of(tensor)
        if found is None and copied is None:
            return tensor
        param, path = found if found is not None else (copied, ())
        history = history_of(param)
        why = history.not_known_yet()
        if why is not None and (self.draws or history.unknown is not None):
            raise MetaConstructionError(
                f"{_caller(func)} reads the values of a parameter of shape {tuple(param.shape)} during construction "
                f"under empty_init, and they are not known before the model is materialised ({why}); build the "
                "model with values: trainer.init_module(empty_init=False), or lp-train init=host"
            )
        if history.value is None:
            history.value = history.replay(param, torch.device("cpu"))
        if copied is not None:
            return history.value.to(tensor.dtype, copy=True)
        return _follow(history.value, path)

    def _known_value(self, tensor: Any) -> Any:
        """``_value`` where it is known now; the tensor itself otherwise (a write from it is then unknown)."""
        try:
            return self._value(tensor, Tensor.copy_)
        except MetaConstructionError:
            return tensor

    def _device_of(self, history: History) -> torch.device:
        """``param.device``: meta, as one that factories given it treat as the device eager construction had
        (the host for a parameter with a value), so a module made ``device=param.device`` draws as there."""
        device = torch.device("meta")
        if history.device != "meta":
            self.devices[id(device)] = (device, history.device)
        return device

    def eager_device(self, device: Any) -> Optional[str]:
        entry = self.devices.get(id(device)) if isinstance(device, torch.device) else None
        return entry[1] if entry is not None and entry[0] is device else None

    def on_eager_device(self, value: Any) -> Any:
        eager = self.eager_device(value)
        return value if eager is None else torch.device(eager)

    def _drawn(self, op: Op, target: Tensor, device: str) -> Op:
        """A random call is made on a scratch tensor of the target's shape, so the generator moves on as
        it would have in eager construction (the draws after it stay the same), and its state before is
        kept for the replay. Others are kept as they are, and so are random calls that eager construction
        would have made on the meta device (which draws nothing: Hugging Face builds a model on meta
        before loading it) or on an accelerator (replayed with the module's seed)."""
        if not self.draws or _name(op.func) not in _RANDOM or device != "cpu":
            return op
        generator = op.kwargs.get("generator")
        own = isinstance(generator, torch.Generator)
        if own and generator.device.type != "cpu":
            return op
        op.rng = generator.get_state() if own else torch.get_rng_state()
        op.call(torch.empty(target.shape, dtype=target.dtype))
        return op

    def _assign(self, history: History, param: nn.Parameter, path: tuple, source: Any, func: Callable) -> None:
        """``param.data = source`` or ``param.copy_(source)`` (through ``path``): a parameter's whole value
        takes the source's record; a real or computable value is kept (the parameter takes its shape)."""
        whole = path == () and (func == _SET_DATA or source.shape == param.shape)
        other = self.alias(source)
        if whole and other is not None and other[1] == () and other[0] is not param:
            source_history = history_of(other[0]).copy()  # replayed, or read, the same way as the other's
            history.reset(source_history.initial)
            history.ops, history.unknown = source_history.ops, source_history.unknown
            history.dtype, history.device = source_history.dtype, source_history.device
            if source.dtype != param.dtype and func is Tensor.copy_:
                history.add(Op((), _SET_DATA, (param.dtype,), {}))
            if func == _SET_DATA:
                _SET_DATA(param, torch.empty_like(source, device="meta"))
            return
        copied = self.copy_of(source)
        if func == _SET_DATA and path == () and copied is param:
            history.add(Op((), _SET_DATA, (source.dtype,), {}))  # param.data = param.to(dtype)
            return
        value = self._known_value(source)
        if not isinstance(value, Tensor) or value.is_meta:
            history.unknown = f"{_name(func)} was given another meta tensor"
        elif whole:
            history.reset(value.detach().to(source.dtype if func == _SET_DATA else param.dtype))
            history.device = value.device.type
            if func == _SET_DATA and (value.shape != param.shape or value.dtype != param.dtype):
                _SET_DATA(param, torch.empty_like(value, device="meta"))
        else:  # a value into part of the parameter: replayable like any other write
            history.add(Op(path, Tensor.copy_, (value.detach(),), {}))


def _follow(tensor: Tensor, path: tuple) -> Tensor:
    """The view of ``tensor`` that ``path`` (view calls, see ``Op``) reaches."""
    for func, args, kwargs, index in path:
        tensor = func(tensor, *args, **kwargs)
        if index is not None:
            tensor = tensor[index]
    return tensor


def _caller(func: Callable) -> str:
    """``func`` and the innermost frames of the code that called it outside torch and this package."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-3]
              if "/torch/" not in f.filename and "/lightning_parallel/" not in f.filename and "contextlib" not in f.filename]
    where = " < ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(frames[-3:]))
    return f"{_name(func)}() in {where}" if where else f"{_name(func)}()"


def _name(func: Callable) -> str:
    return getattr(func, "__name__", str(func))


def unreplayable(model: nn.Module) -> dict[str, str]:
    """Parameter name -> why its value cannot be given on the meta device (a construction that could not
    be recorded, or nothing that sets it); empty when every parameter can be materialised."""
    found = {}
    for name, param in model.named_parameters():
        history = history_of(param)
        if history is None:
            continue
        if history.unknown is not None:
            found[name] = history.unknown
        elif history.initial is None and not history.ops:
            found[name] = "nothing sets its value"
    return found


def _defer(param: nn.Parameter, source: Any) -> bool:
    """A parameter's value is ``source`` (read later, by ``materialize``), if it was made under our hooks."""
    history = history_of(param)
    if history is None:
        return False
    history.reset(source)
    history.device = "cpu"  # where the loaded value would be: a module made on its device draws as there
    return True


@contextmanager
def empty_parameters(draws: bool = True) -> Generator[None, None, None]:
    """Inside, modules create their parameters on the meta device and every value construction gives
    them is recorded (see the module docstring). ``draws=False`` skips drawing the random numbers that
    keep later draws as in eager construction (for a model built only to read its shapes)."""
    recorder = _Recorder(draws)
    register = nn.Module.register_parameter
    new_parameter = nn.Parameter.__new__

    def parameter_on_meta(cls, data=None, requires_grad=True):
        if cls is not nn.Parameter:  # Lazy and other special parameters keep their own construction
            return new_parameter(cls, data, requires_grad)
        data = torch.empty(0) if data is None else data
        history = recorder.source_of(data)
        meta = new_parameter(cls, torch.empty_like(data, device="meta"), requires_grad)
        return recorder.track(meta, history)

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        lazy = isinstance(param, nn.parameter.UninitializedParameter)  # takes its shape at the first forward
        if param is not None and not lazy and history_of(param) is None:  # made before the context, or elsewhere
            history = History(device=param.device.type) if param.is_meta else History(initial=param.detach())
            meta = new_parameter(nn.Parameter, torch.empty_like(param, device="meta"), param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = recorder.track(meta, history)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    nn.Parameter.__new__ = parameter_on_meta
    try:
        with recorder, deferred_pretrained_reads(_defer), warnings.catch_warnings():
            # load_state_dict warns that copying into a meta parameter is a no-op: here it is recorded
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
            yield
    finally:
        nn.Module.register_parameter = register
        nn.Parameter.__new__ = new_parameter


@contextmanager
def recording(model: nn.Module) -> Generator[None, None, None]:
    """Inside, in-place calls on ``model``'s parameters built under ``empty_parameters()`` are recorded
    as construction's were (replayed by ``materialize.py``), so a model's init functions called after
    construction (``model.apply(model._init_weights)``, ``reset_parameters()``) give their values too.
    Random calls draw as they would have on the host, in the order they are made. Inside the build's own
    ``empty_parameters()`` it adds nothing: that records already."""
    if any(isinstance(mode, _Recorder) for mode in torch.overrides._get_current_function_mode_stack()):
        yield
        return
    recorder = _Recorder(draws=True)
    for param in model.parameters():
        history = history_of(param)
        if history is not None:
            recorder.track(param, history)
    with recorder, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
        yield


def reset_recorded(model: nn.Module) -> bool:
    """Call every module's ``reset_parameters()`` (in ``model.modules()`` order) under ``recording``, when
    ``model`` holds parameters built under ``empty_parameters()``: what FSDP does to a model built on the
    meta device when it materialises it. Returns whether it did."""
    if not any(history_of(p) is not None for p in model.parameters()):
        return False
    with recording(model):
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    return True

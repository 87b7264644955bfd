"""`lp-train`'s model summary: Lightning's rich table, without a FLOPs column that counted nothing.

Lightning counts FLOPs only by running ``example_input_array`` through the model; a module without
one gets a FLOPs column of zeros and "Total FLOPs: 0". This summary shows the column and the total
when something was counted, and leaves both out otherwise. Under tensor or pipeline parallelism
the strategy still hands it the whole model's parameter counts (``strategy/summary.py``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)


class ParameterSummary(RichModelSummary):
    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        if total_flops:
            return RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                              total_training_modes, total_flops, **summarize_kwargs)
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name.startswith("Params") else "left",
                             style="dim" if name == " " else None, no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        totals = Table.grid(expand=True)
        totals.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            totals.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(totals)
        return None

"""Config-group choices that select another group's choice: `algorithm=demo` runs with
`optimizer=demo` (DeMo's step, lr and weight decay live in that optimizer node);
`algorithm=desloc` with `optimizer=adamw` (DES-LOC averages Adam's moments).

Hydra lets a config override only a group listed before it in the primary defaults list.
`optimizer` comes after `algorithm` there, so `optimizer=onebit_adam|zero_one_adam|demo` select
their algorithm in YAML, but `algorithm=demo` cannot select its optimizer the same way. The
override is added to the command line instead, before anything composes it: the CLI's single
runs, each sweep point, a study's in-process points. A choice the user made for the selected
group stands (the configuration check then says what pairs with what).
"""

from __future__ import annotations

from collections.abc import Sequence

# (group, choice) -> (group, choice) it selects when the command line does not choose it.
SELECTS: dict[tuple[str, str], tuple[str, str]] = {
    ("algorithm", "demo"): ("optimizer", "demo"),
    ("algorithm", "desloc"): ("optimizer", "adamw"),  # DES-LOC is local Adam
}


def with_selected_choices(overrides: Sequence[str]) -> list[str]:
    """`overrides` plus the choices their group choices select (`SELECTS`) where the command
    line names no choice for that group. A sweep over the selecting group (`algorithm=demo,sync`)
    is left as it is: each point's check names the pairing."""
    out = list(overrides)
    named = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        selected = SELECTS.get((key, value))
        if selected is not None and selected[0] not in named:
            out.append(f"{selected[0]}={selected[1]}")
            named.add(selected[0])
    return out

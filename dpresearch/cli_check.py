"""Turn Hydra composition failures (unknown option, unknown key, bad type) into one line.

Hydra's own messages span several lines and a stack hint; `composition_error` composes the
command line's overrides first and, if that fails, returns a single sentence naming the fix.
Sweeps (`a=1,2`) are checked value by value for config-group choices and composed with their
first value. Anything this check cannot interpret is left to Hydra.
"""

from __future__ import annotations

from pathlib import Path

HYDRA_FLAGS_THAT_EXIT = {
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
}
FLAGS_WITH_VALUE = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--cfg",
    "-c",
    "--package",
    "-p",
}


def _overrides(argv: list[str]) -> list[str] | None:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in HYDRA_FLAGS_THAT_EXIT:
            return None
        if arg in FLAGS_WITH_VALUE:
            skip = True
            continue
        if arg.startswith("-"):
            continue
        out.append(arg)
    return out


def _group_options(conf_dir: Path, group: str) -> list[str]:
    folder = conf_dir / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def composition_error(argv: list[str], conf_dir: Path) -> str | None:
    """None if the command line composes; otherwise one line describing the fix."""
    overrides = _overrides(argv)
    if overrides is None:
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        return f"cannot parse the overrides: {str(exc).splitlines()[0]}"
    first_values = []
    for ov in parsed:
        key = ov.key_or_group
        if key.startswith("hydra") or ov.package is not None and ov.package.startswith("hydra"):
            continue
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else None
        options = _group_options(conf_dir, key)
        if options and not ov.is_delete():
            for value in values or [ov.value()]:
                if isinstance(value, str) and value not in options:
                    return f"{key}={value} is not an option; choose one of: {', '.join(options)}"
        if values is not None:
            first_values.append(f"{ov.get_key_element()}={values[0]}")
        else:
            first_values.append(ov.input_line)
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            compose(config_name="config", overrides=first_values)
    except Exception as exc:  # noqa: BLE001 - every composition failure is reported alike
        text = str(exc)
        if exc.__cause__ is not None:
            text += "\n" + str(exc.__cause__)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if "is not in struct" in text or "Could not override" in text:
            key = lines[0].split("'")[1] if "'" in lines[0] else lines[0]
            return (
                f"{key} is not a config key; list the keys with --cfg job, "
                f"or add a new one with +{key}=..."
            )
        detail = [ln for ln in lines if "could not be converted" in ln or "Invalid value" in ln]
        if detail:
            return f"{lines[0]}: {detail[0]}"
        return lines[0] if lines else type(exc).__name__
    return None

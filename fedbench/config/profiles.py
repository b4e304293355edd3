"""A preset's profiles (``table.profiles[name]``: ``sweep`` axes and ``set`` overrides), shared by the sweep
expansion of the scripts and by ``run.py experiment=<preset> profile=<name>``."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional

from fedbench.errors import FedbenchError

DEFAULT_PROFILE = "paper"   # what the scripts run when a preset is given without profile=
_PLAIN = re.compile(r"^[A-Za-z0-9_.\-/:+]*$")


def quote_value(value: Any) -> str:
    """Quote an override value that Hydra's grammar would otherwise split (e.g. 'beta=0.05', '#C=2')."""
    v = str(value)
    if v.startswith("[") and v.endswith("]"):   # a list value (a block's aggregators) stays a list
        return v
    return v if _PLAIN.match(v) else "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


def table_profile(table: Optional[Mapping], profile: Optional[str]) -> Dict[str, Any]:
    """The profile ``{sweep: {...}, set: {...}}`` of a preset's table (``profile=null`` = paper); an unknown
    name, or a profile without a preset table, is an error."""
    if not table:
        if profile is None:
            return {}
        raise FedbenchError(f"profile={profile} needs an experiment preset with table.profiles "
                            f"(e.g. experiment=fedlpa/table6 profile={profile}); without one, profile must be null")
    profiles = table.get("profiles") or {}
    name = DEFAULT_PROFILE if profile is None else profile
    if name not in profiles:
        raise FedbenchError(f"preset {table.get('paper')}/{table.get('id')} has no profile '{name}'; "
                            f"choose one of: {', '.join(profiles) or '(none)'}")
    return dict(profiles[name] or {})


def set_overrides(prof: Mapping, fixed_keys) -> List[str]:
    """The profile's ``set`` as overrides, except keys the command line fixes."""
    return [f"{k}={quote_value(v)}" for k, v in (prof.get("set") or {}).items() if k not in fixed_keys]


def single_run_overrides(prof: Mapping, cli_keys) -> List[str]:
    """What one ``run.py`` run takes from a profile: its ``set``, and every ``sweep`` axis with a single value
    (``local.epochs: [2]`` is a setting); axes with several values (seeds) are left to the run's own config."""
    out = set_overrides(prof, cli_keys)
    for key, values in (prof.get("sweep") or {}).items():
        vals = values if isinstance(values, (list, tuple)) else [values]
        if len(vals) == 1 and key not in cli_keys:
            out.append(f"{key}={quote_value(vals[0])}")
    return out

"""The packages stack without cycles: the loop knows nothing of the controls put around it,
and the assembly, above both, is imported by nobody below it."""

from __future__ import annotations

import subprocess
import sys

# package -> stockade packages it must never load, directly or through another
BELOW: dict[str, tuple[str, ...]] = {
    "stockade.agent": ("stockade.assembly", "stockade.policy", "stockade.runtime", "stockade.audit"),
    "stockade.policy": ("stockade.assembly",),
    "stockade.runtime": ("stockade.assembly",),
    "stockade.audit": ("stockade.assembly",),
    "stockade.runs": ("stockade.assembly",),
    "stockade.sandbox": ("stockade.agent", "stockade.assembly", "stockade.tools"),
}


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def test_each_package_loads_nothing_above_it() -> None:
    for package, forbidden in BELOW.items():
        loaded = _loaded_after_import(package)
        above = sorted(m for m in loaded if m.split(".")[:2] in [f.split(".") for f in forbidden])
        assert not above, f"importing {package} loads {above}"


def test_the_command_line_loads_no_optional_dependency_until_a_command_needs_it() -> None:
    optional = ("docker", "psycopg", "redis", "limits", "yaml", "openai", "anthropic", "opentelemetry")
    loaded = _loaded_after_import("stockade.cli.main")
    assert sorted(m for m in loaded if m.split(".")[0] in optional) == []

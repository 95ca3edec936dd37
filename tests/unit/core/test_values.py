"""Value objects validate themselves; paths are checked before reaching any sandbox."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stockade import ConfigurationError, Limits, PathEscapeError
from stockade.sandbox.facade import check_path, text_sink


@pytest.mark.parametrize(
    "bad", [{"memory_mb": 0}, {"cpus": -1}, {"pids": 2}, {"timeout_s": 0}, {"output_bytes": 0}]
)
def test_limits_refuse_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        Limits(**bad)  # type: ignore[arg-type]


def test_limits_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Limits().memory_mb = 1  # type: ignore[misc]


segment = st.sampled_from(["a", "b", "..", ".", "", "src", "x.py"])


@given(st.lists(segment, max_size=8), st.booleans())
def test_no_accepted_path_climbs_out_of_the_workspace(parts: list[str], absolute: bool) -> None:
    path = ("/workspace/" if absolute else "") + "/".join(parts)
    depth = 0
    escapes = path.startswith("/") and not path.startswith("/workspace")
    for part in path.removeprefix("/workspace").split("/"):
        if part == "..":
            depth -= 1
            escapes = escapes or depth < 0
        elif part not in ("", "."):
            depth += 1
    if escapes:
        with pytest.raises(PathEscapeError):
            check_path(path)
    else:
        assert check_path(path) == path


@pytest.mark.parametrize("path", ["/etc/passwd", "/workspacex/a", "a\x00b", "../a"])
def test_obviously_bad_paths_are_refused(path: str) -> None:
    with pytest.raises(PathEscapeError):
        check_path(path)


def test_streamed_text_survives_a_character_split_across_chunks() -> None:
    seen: list[str] = []
    sink = text_sink(seen.append, None)
    assert sink is not None
    data = "héllo €".encode()
    for i in range(len(data)):
        sink(1, data[i : i + 1])
    assert "".join(seen) == "héllo €"

"""The host's file table (``_filetable``): what a sandbox holds in it through mappings, and
whether the host's ``fs.file-max`` lets memory, not that count, bound it. The sysctl is
read, never written: the host's setup (``scripts/setup-host.sh``) sets it once."""

from __future__ import annotations

from stockade.cli.sandbox_cmds import file_table_fix
from stockade.sandbox import _filetable

MiB = 1 << 20


def test_mapped_files_are_what_the_memory_pays_for_and_what_the_tasks_may_map() -> None:
    assert _filetable.mapped_files(256, 64, per_task=65530) == 256 * MiB // 384  # 699,050
    assert _filetable.mapped_files(4096, 2, per_task=65530) == 2 * 65530
    assert _filetable.mapped_files(256, 64) > 0  # this host's vm.max_map_count


def test_the_host_is_short_when_its_memory_holds_more_files_than_file_max() -> None:
    memory = 8 << 30  # 22 million mapped files' worth
    assert _filetable.short_by(2_466_093, memory) == memory // 384 - 2_466_093
    assert _filetable.short_by(_filetable.UNBOUNDED, memory) == 0


def test_doctor_says_how_to_raise_file_max_and_nothing_when_it_is_raised() -> None:
    fix = file_table_fix(2_466_093, 8 << 30)
    assert "ENFILE" in fix and "scripts/setup-host.sh" in fix and str(_filetable.UNBOUNDED) in fix
    assert file_table_fix(_filetable.UNBOUNDED, 8 << 30) == ""

"""Each op says what the sandbox answers, on both sides: mypy checks the ``assert_type`` lines
below (the tests are type-checked), and running them checks the values agree."""

from __future__ import annotations

from typing import assert_type

from stockade.sandbox.base import AsyncInstance, Instance, SandboxSpec, ThreadedAsyncBackend
from stockade.sandbox.ops import (
    GetArchive,
    ListDir,
    MakeDir,
    PutArchive,
    ReadFile,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    Stat,
    WriteFile,
)
from stockade.testing import FakeBackend
from stockade.types import CommandResult, EntryInfo, Execution, Listing


def _sync(sbx: Instance) -> None:
    assert_type(sbx.execute(RunCommand(argv=("true",))), CommandResult)
    assert_type(sbx.execute(RunCode(code="1")), Execution)
    assert_type(sbx.execute(WriteFile(path="a", data=b"x")), EntryInfo)
    assert_type(sbx.execute(ReadFile(path="a")), bytes)
    assert_type(sbx.execute(Stat(path="a")), EntryInfo | None)
    assert_type(sbx.execute(ListDir()), Listing)
    assert_type(sbx.execute(MakeDir(path="d")), EntryInfo)
    assert_type(sbx.execute(GetArchive()), bytes)
    assert_type(sbx.execute(PutArchive(data=sbx.execute(GetArchive()))), None)
    assert_type(sbx.execute(Remove(path="a")), None)
    assert_type(sbx.execute(Reset()), None)


async def _async(sbx: AsyncInstance) -> None:
    assert_type(await sbx.aexecute(RunCommand(argv=("true",))), CommandResult)
    assert_type(await sbx.aexecute(RunCode(code="1")), Execution)
    assert_type(await sbx.aexecute(WriteFile(path="a", data=b"x")), EntryInfo)
    assert_type(await sbx.aexecute(ReadFile(path="a")), bytes)
    assert_type(await sbx.aexecute(Stat(path="a")), EntryInfo | None)
    assert_type(await sbx.aexecute(ListDir()), Listing)
    assert_type(await sbx.aexecute(Remove(path="a")), None)


def test_the_sync_side_answers_each_op_with_its_type() -> None:
    _sync(FakeBackend().start(SandboxSpec()))


async def test_the_async_side_answers_each_op_with_its_type() -> None:
    await _async(FakeBackend().start(SandboxSpec()))
    await _async(await ThreadedAsyncBackend(FakeBackend()).astart(SandboxSpec()))

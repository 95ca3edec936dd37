"""A checkpoint costs the same late in a run as early: only what is new is written, and a long
text the run sees again and again (the same file read at every step) is redacted once."""

from __future__ import annotations

from stockade import Sandbox
from stockade.agent import Agent, RunLimits
from stockade.audit import Redactor, redact_tokens
from stockade.models import FunctionModel, ModelRequest, ModelResponse, ToolCall, Usage
from stockade.runs import open_run_store
from stockade.testing import FakeBackend

FILE = "".join(f"line {i}: some code here\n" for i in range(40))
STEPS = 12


class CountingRedaction:
    """A redaction step that counts how often it saw ``FILE``'s text."""

    def __init__(self) -> None:
        self.long_texts = 0

    def __call__(self, text: str) -> str:
        if "line 39: some code here" in text:
            self.long_texts += 1
        return redact_tokens(text)


def read_the_same_file_every_step(redactor: Redactor) -> None:
    call = ToolCall(id="c", name="read_file", args={"path": "app.py"})

    def answer(request: ModelRequest) -> ModelResponse:
        done = len(request.messages) >= 2 * STEPS + 1
        return ModelResponse(
            text="done" if done else "", tool_calls=() if done else (call,), usage=Usage(requests=1)
        )

    sbx = Sandbox.create(backend=FakeBackend())
    sbx.files.write("app.py", FILE)
    with open_run_store("memory:", redactor=redactor) as store:
        agent = Agent(FunctionModel(answer), checkpointer=store, limits=RunLimits(max_steps=STEPS + 2))
        assert agent.run_sync("read it", sandbox=sbx, run_id="r").ok
        state = store.load("r")
    assert state is not None and len(state.steps) == STEPS + 1
    assert state.steps[-2].tool_calls[0].observation.endswith("line 39: some code here")


def test_a_long_text_seen_at_every_step_is_redacted_once_per_store() -> None:
    counting = CountingRedaction()
    read_the_same_file_every_step(Redactor([counting]))
    # the observation, its message and the ledger row repeat it STEPS times: all remembered
    assert counting.long_texts == 1


def test_a_secret_registered_later_is_still_redacted_in_what_was_remembered() -> None:
    redactor = Redactor()
    remembering = redactor.remembering()
    text = "x" * 100 + " hunter2-correct-horse"
    assert remembering.text(text) == text
    redactor.add_secret("hunter2-correct-horse")  # on the redactor the store was given
    assert remembering.text(text) == "x" * 100 + " [REDACTED:secret]"


def test_remembering_is_bounded() -> None:
    counting = CountingRedaction()
    remembering = Redactor([counting]).remembering(max_chars=len(FILE) * 2)
    for suffix in "abc":  # three long texts, room for two: the first is forgotten
        remembering.text(FILE + suffix)
    remembering.text(FILE + "a")
    assert counting.long_texts == 4

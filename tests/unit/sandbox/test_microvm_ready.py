"""Ready images: what an image holds of a sandbox's configuration, what is sent after the
resume, and what makes two images differ (the images themselves: tests/integration)."""

from __future__ import annotations

import dataclasses
from typing import Any

from stockade.sandbox import _rules
from stockade.sandbox._microvm_ready import LATE, ReadyImages, image_config, resume_args
from stockade.sandbox._supervised_config import supervisor_config
from stockade.sandbox.base import SandboxSpec
from stockade.types import Enforcement, Limits, Mechanism, SandboxRules

RELAY = {"listen": 3128, "fd": 9, "dir": "/tmp/.stockade-egress", "files": {"ca.pem": "CA"}}


class _Egress:
    def __init__(self) -> None:
        self.env = {"HTTP_PROXY": "http://127.0.0.1:3128"}
        self.relay = RELAY
        self.preload: str | None = None  # the microVM's programs take its relay
        self.violation: str | None = None

    def renew(self) -> None:
        pass

    def close(self) -> None:
        pass


def _frames(spec: SandboxSpec, *, egress: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sandbox's configuration frame and its image's."""
    config = supervisor_config(spec, None, _Egress() if egress else None)
    base = supervisor_config(dataclasses.replace(spec, envs={}))["env"]
    return config, image_config(config, base)


ENFORCEMENT = Enforcement(
    memory=Mechanism.VM, cpus=Mechanism.VM, pids=Mechanism.RLIMIT, disk=Mechanism.TMPFS,
    network=Mechanism.VM, timeout=Mechanism.SUPERVISOR,
)  # fmt: skip


def _name(spec: SandboxSpec) -> str:
    rules = _rules.plan(spec, root=None, can_mask=True, can_confine=True)
    return ReadyImages.name("machine", _frames(spec)[1], rules, ENFORCEMENT)


def test_the_callers_variables_and_the_relay_stay_out_of_the_image_and_are_sent_after_the_resume() -> None:
    spec = SandboxSpec(envs={"API_TOKEN": "secret", "LANG": "C"})
    config, image = _frames(spec, egress=True)
    assert "secret" not in repr(image) and "egress" not in image and "HTTP_PROXY" not in image["env"]
    assert image["env"]["LANG"] == "C.UTF-8"  # the default the caller's variable overrides
    rest = {k: v for k, v in config.items() if k not in ("env", "egress", *LATE)}
    assert {k: v for k, v in image.items() if k != "env"} == rest
    sent = resume_args(config, image)
    late = {"timeout": config["timeout"], "output_cap": config["output_cap"]}
    assert sent == {"env": config["env"], "egress": RELAY, **late}
    assert list(sent["env"]) == list(config["env"])  # the cold start's order
    plain_config, plain_image = _frames(SandboxSpec())
    assert resume_args(plain_config, plain_image) == late  # only the settings read per request


def test_one_image_serves_every_set_of_variables_and_each_configuration_has_its_own() -> None:
    plain = _name(SandboxSpec())
    assert _name(SandboxSpec(envs={"A": "1"})) == plain
    assert _name(SandboxSpec(labels={"team": "x"})) == plain
    # Read per request, sent with the reseed: not the image's
    assert _name(SandboxSpec(limits=Limits(timeout_s=7, output_bytes=4096))) == plain
    others = {
        _name(SandboxSpec(limits=Limits(open_files=4096))),
        _name(SandboxSpec(rules=SandboxRules(deny=("rm -r",)))),
        _name(SandboxSpec(rules=SandboxRules(deny=("git push",)))),
        _name(SandboxSpec(rules=SandboxRules(write=("src/**",)))),
        _name(SandboxSpec(rules=SandboxRules(approve=("rm -r",)))),
        _name(SandboxSpec(rules=SandboxRules(approve=("rm -r",)), approver=lambda record: True)),
    }
    assert plain not in others and len(others) == 6


def test_a_fresh_sandbox_is_served_one_named_or_seeded_is_not() -> None:
    ready = ReadyImages(enabled=True)
    assert ready.serves(SandboxSpec(envs={"A": "1"}, rules=SandboxRules(deny=("curl",))))
    assert not ready.serves(SandboxSpec(sandbox_id="sbx-0123456789ab"))
    assert not ReadyImages(enabled=False).serves(SandboxSpec())

"""The service's access log (uvicorn's) shows a request's path and the names of its query,
never a value: a client that put its token there (``GET /ui/login?key=stk_...``) had it written
whole into the operator's logs."""

from __future__ import annotations

import logging

import pytest

from stockade.server.serving import RedactedQueries, log_config, redacted

TOKEN = "stk_0123456789ab_c2VjcmV0LXNlY3JldC1zZWNyZXQ"


@pytest.mark.parametrize(
    ("target", "shown"),
    [
        ("/v1/runs", "/v1/runs"),
        (f"/ui/login?key={TOKEN}", "/ui/login?key=..."),
        (f"/v1/runs?limit=5&token={TOKEN}&label=team=core", "/v1/runs?limit=...&token=...&label=..."),
        (f"/ui/login?{TOKEN}", "/ui/login?..."),  # a bare word may be the token itself
        (f"/ui/login?{TOKEN}=1", "/ui/login?stk_...=..."),
        (f"/v1/sandboxes/{TOKEN}/files", "/v1/sandboxes/stk_.../files"),
        ("/v1/runs?", "/v1/runs?"),
    ],
)
def test_an_access_line_shows_the_path_and_the_querys_names_alone(target: str, shown: str) -> None:
    assert redacted(target) == shown


def test_uvicorns_access_line_is_written_redacted() -> None:
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", f"/ui/login?key={TOKEN}", "1.1", 200), None,
    )  # fmt: skip
    assert RedactedQueries().filter(record)
    assert record.getMessage() == '127.0.0.1:5000 - "GET /ui/login?key=... HTTP/1.1" 200'


def test_a_line_of_another_shape_is_left_as_it_is() -> None:
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "%s", ("as it is",), None)
    assert RedactedQueries().filter(record) and record.getMessage() == "as it is"


def test_the_servers_log_config_filters_the_access_logger_itself() -> None:
    """On the logger, not on uvicorn's handler: a handler an operator adds gets it redacted too."""
    config = log_config()
    [name] = config["loggers"]["uvicorn.access"]["filters"]
    assert config["filters"][name] == {"()": RedactedQueries}
    assert "filters" not in config["handlers"]["access"]

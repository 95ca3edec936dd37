"""The model of a download's tree, and where its links lead: the link check of ``Extraction``.

Apart from the extraction because it touches no file: it resolves a link the way the kernel
would (links followed, at most ``LINK_HOPS`` of them, ``..`` applied where they lead, missing
parts taken as folders) over any tree a ``Child`` function describes, the model of the
archive or the real tree under ``dest``, and bounds the work of one pass over a download's
links (``_Meter``, ``LINK_WORK``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from stockade import exceptions as exc

__all__ = ["LINK_HOPS", "LINK_STEPS", "LINK_WORK", "Parts"]

LINK_HOPS = 40  # links followed to resolve one link, as the kernel allows
LINK_STEPS = 512  # path components walked to resolve one link, links expanded
LINK_WORK = 8_000_000  # steps of one pass over a download's links (about a second of CPU)

Parts = tuple[str, ...]
H = TypeVar("H")


# -- the model of the tree ---------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Node:
    kind: str  # "dir", "file" or "link"
    mode: int = 0o700  # a folder's final mode
    target: str = ""  # a link's target
    inode: tuple[int, int] = (0, 0)  # a file's (st_dev, st_ino) as created here
    hard: bool = False  # a file made as a further name of another
    children: dict[str, _Node] | None = None

    @classmethod
    def folder(cls, mode: int = 0o700) -> _Node:
        return cls("dir", mode=mode, children={})


# -- where a link leads ------------------------------------------------------------------


def _components(target: str) -> list[str]:
    return [p for p in target.split("/") if p not in ("", ".")]


Child = Callable[[H | None, str], tuple[str, str, H | None]]


@dataclass(slots=True)
class _Meter:
    """The work of one pass over a download's links: each component walked or queued, each
    folder looked up. A link costs at most ``LINK_STEPS`` steps (and ``LINK_HOPS`` targets
    queued), so without a bound of its own 100,000 links of a download cost minutes."""

    limit: int
    dest: str
    used: int = 0

    def charge(self, n: int = 1) -> None:
        self.used += n
        if self.used > self.limit:
            raise exc.FileTooLarge(
                f"checking the links of the download into {self.dest!r} takes more than "
                f"{self.limit} steps (links through links, long targets, deep folders)",
                path=self.dest,
            )


def _starts(
    links: list[tuple[Parts, _Node]], root: H, descend: Callable[[H | None, str], H | None], meter: _Meter
) -> Iterator[tuple[Parts, _Node, list[H | None]]]:
    """Each link with the handles of its folder's chain, root first. Links come in walk
    order: the chain is kept from one to the next and only what changes is looked up, once
    per folder (rebuilt per link, it cost depth squared: minutes for 20,000 links 127 deep)."""
    parts_now: Parts = ()
    chain: list[H | None] = [root]
    for parts, node in links:
        folder = parts[:-1]
        if folder != parts_now:
            keep = 0
            while keep < min(len(folder), len(parts_now)) and folder[keep] == parts_now[keep]:
                keep += 1
            del chain[keep + 1 :]
            for name in folder[keep:]:
                meter.charge()
                chain.append(descend(chain[-1], name))
            parts_now = folder
        yield parts, node, chain


def _leaves(start: list[H | None], target: str, child: Child[H], meter: _Meter) -> str | None:
    """Why a link in the folder ``start`` (handles from the root down) to ``target`` would
    leave the root, or None when every step of its resolution stays inside.

    ``child(folder, name)`` says what ``name`` is: ``("dir", "", handle)``, ``("link",
    target, None)``, ``("file", "", None)`` or ``("missing", "", None)``; a missing name is
    taken as a folder, so that the answer holds whatever is made there later.
    """
    if target.startswith("/"):
        return "is absolute"
    why = _up_through_folders(start, target, child, meter)
    if why is not None:
        return why
    here = list(start)
    queue = deque(_components(target))
    steps = hops = 0
    while queue:
        steps += 1
        meter.charge()
        if steps > LINK_STEPS:
            return f"takes more than {LINK_STEPS} steps to resolve"
        part = queue.popleft()
        if part == "..":
            if len(here) == 1:
                return "leads out of the folder"
            here.pop()
            continue
        kind, link, handle = child(here[-1], part)
        if kind == "link":
            hops += 1
            if hops > LINK_HOPS:
                return f"goes through more than {LINK_HOPS} links"
            if link.startswith("/"):
                return f"goes through {part!r}, a link to the absolute path {link!r}"
            more = _components(link)
            meter.charge(len(more))
            queue.extendleft(reversed(more))
        elif kind == "file" and queue:
            return f"goes through {part!r}, which is not a folder"
        else:
            here.append(handle)
    return None


def _up_through_folders(start: list[H | None], target: str, child: Child[H], meter: _Meter) -> str | None:
    """Why the ``..`` of a link's target may lead elsewhere later, or None: each must undo a
    name that is a real folder, reached through real folders. ``x/..`` goes to the parent of
    wherever ``x`` leads when it is followed: a later download, or a link already in ``dest``,
    can make a missing ``x`` (or a link ``x``) a link to ``.``, and two downloads into one
    folder left ``x/../secret`` pointing at the folder's parent. Folders are never replaced
    (``_make_room``), so a ``..`` after folders only stays where this check puts it."""
    here = list(start)
    settled = True  # every name so far a real folder
    for part in _components(target):
        meter.charge()
        if part == "..":
            if not settled:
                return "goes up ('..') after a name that is no folder: it leads wherever that name will"
            if len(here) == 1:
                return "leads out of the folder"
            here.pop()
        elif settled:
            kind, _, handle = child(here[-1], part)
            if kind == "dir":
                here.append(handle)
            else:
                settled = False
    return None


def _model_child(folder: _Node | None, name: str) -> tuple[str, str, _Node | None]:
    node = None if folder is None or folder.children is None else folder.children.get(name)
    if node is None:
        return "missing", "", None
    return node.kind, node.target, node if node.kind == "dir" else None


def _model_folder(folder: _Node | None, name: str) -> _Node | None:
    return _model_child(folder, name)[2]


def _host_folder(folder: str | None, name: str) -> str:
    return f"{folder}/{name}" if folder else name

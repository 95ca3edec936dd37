"""Command rules over one program's argv: whether ``rm -fR build`` is ``rm -r``.

One implementation for both sides: the host's policy judges the commands a tool call names
with it, and the supervisor judges every exec inside the sandbox with it, when it happens,
with the argv the kernel was given. Standard library only (it runs inside the sandbox).

A pattern is shell words: the program (a glob over its name), then flags the command must
carry and words that must be among its other arguments: ``"rm -r"``, ``"git push"``,
``"pip install"``. A flag matches its spellings for that program: ``rm -fR``, ``rm -r -f``,
``rm --recursive`` and its abbreviations (``rm --recu``: GNU getopt, git's and Python's
option parsers take any unambiguous prefix) all carry ``-r``.

Here: how a rule is matched (``matches``, ``allows``, ``judge``, ``judged_words``) and the
files an allowlist lets run (``allowlisted``, ``run_as``). What one program's command line
means is beside it: git's (``execgit``), npm's (``execnpm``), and what an interpreter, a
loader or a script runs (``execruns``).
"""

from __future__ import annotations

# On the host these are modules of stockade (the policy judges with them); in the sandbox
# the supervisor's folder is the path, and its modules are imported by name.
if __package__:
    from . import execgit, execnpm, execruns
else:
    import execgit
    import execnpm
    import execruns

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

# The same action under other spellings, per program ("*": any program): a pattern's flag
# matches any of them, alone, in a cluster of short flags (``-fR``), or as ``--long=value``.
FLAG_SPELLINGS = {
    "*": {"-r": ("-r", "-R", "--recursive"), "-f": ("-f", "--force")},
    "cp": {"-r": ("-r", "-R", "--recursive", "-a", "--archive")},
    "chmod": {"-R": ("-R", "--recursive")},
    "chown": {"-R": ("-R", "--recursive")},
    "chgrp": {"-R": ("-R", "--recursive")},
    # git push's refspec with a leading "+" forces that ref (``git push origin +main``)
    "git": {"-f": ("-f", "--force", "--force-with-lease", "--force-if-includes", "+")},
    "pip": {
        "-e": ("-e", "--editable"), "-r": ("-r", "--requirement"), "-U": ("-U", "--upgrade"),
        "-i": ("-i", "--index-url"), "--index-url": ("-i", "--index-url"),
        "-f": ("-f", "--find-links"), "--find-links": ("-f", "--find-links"),
    },
}  # type: Dict[str, Dict[str, Tuple[str, ...]]]  # fmt: skip
VERDICTS = ("allow", "approve", "deny")


def rule_names(name: str) -> "Tuple[str, ...]":
    """The names a program's rules are written under: its own, and without a version
    (``pip3.11``, ``python3`` are ``pip``, ``python``) or a dashed git command (``git-push``
    is ``git push``: git runs the command its argv[0] names), or a shorthand's (``npx``:
    ``npm``)."""
    names = [name]
    bare = name.rstrip("0123456789.")
    if bare and bare != name:
        names.append(bare)
    if name.startswith("git-") and len(name) > 4:
        names.append("git")
    if name in execnpm.SHORTHANDS:
        names.append(execnpm.SHORTHANDS[name][0])
    return tuple(names)


def pattern(words: "Sequence[str]") -> "List[str]":
    """A rule's words as the commands they are matched against: ``git-push x`` is the rule
    ``git push x`` (a dashed git command is git's), so that it holds over both spellings."""
    return _dashed(words) if words else []


def _dashed(command: "Sequence[str]") -> "List[str]":
    """``git-push x`` as git runs it: ``git push x``; git's plumbing that does what a porcelain
    command does, as that command (``git send-pack`` pushes: ``git push``); npm's command by
    its name, whatever spelling npm takes for it (``npm add``, ``npx``: ``npm install``,
    ``npm exec``)."""
    name = execruns.program(command[0])
    if name.startswith("git-") and len(name) > 4:
        command = ["git", name[4:], *command[1:]]
    if execruns.program(command[0]) == "git":
        return [command[0], *(execgit.GIT_PLUMBING.get(word, word) for word in command[1:])]
    if execruns.program(command[0]) in execnpm.SHORTHANDS:  # npx x is npm exec x
        command = [*execnpm.SHORTHANDS[execruns.program(command[0])], *command[1:]]
    if execruns.program(command[0]) == "npm":  # npm add x, npm isntall x: npm install x
        args = list(command[1:])
        for at in execnpm.npm_slots(args):
            args[at] = execnpm.npm_command(args[at]) or args[at]
        return [command[0], *args]
    return list(command)


def _spellings(name: str, flag: str) -> "Tuple[str, ...]":
    """Every spelling of the action ``flag`` is one of (the program's own table first): a rule
    written ``rm --recursive`` or ``rm -R`` holds over ``rm -r`` as ``rm -r`` does."""
    for table in (FLAG_SPELLINGS.get(name, {}), FLAG_SPELLINGS["*"]):
        if flag in table:
            return table[flag]
        for spellings in table.values():
            if flag in spellings:
                return spellings
    return (flag,)


def _flags(name: str, word: str) -> "List[str]":
    """The flags a rule's word requires: a cluster of short flags (``rm -fr``) each of its
    letters, where the program's spellings know every one of them (``find -exec`` stays
    one word); any other word itself."""
    if word.startswith("--") or len(word) <= 2 or not word[1:].isalpha():
        return [word]
    letters = ["-" + letter for letter in word[1:]]
    return letters if all(_spellings(name, flag) != (flag,) for flag in letters) else [word]


def _carries(name: str, flag: str, args: "Sequence[str]") -> bool:
    return _carrier(name, flag, args) is not None


def _carrier(name: str, flag: str, args: "Sequence[str]") -> "Optional[str]":
    """The first of ``args`` that carries ``flag`` (in any of its spellings), if any."""
    spellings = _spellings(name, flag)
    letters = [s[1] for s in spellings if len(s) == 2 and s[0] == "-" and s[1] != "-"]
    longs = [s for s in spellings if s.startswith("--")]
    for arg in args:
        if arg == "--":
            return None  # what follows are operands, even when they look like flags
        if arg in spellings or any(_abbreviates(arg, long) for long in longs):
            return arg
        if "+" in spellings and arg.startswith("+") and len(arg) > 1:
            return arg
        if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
            cluster = arg[1:]
            # -fR: every letter a flag; stop at the first that takes a value (-ofile)
            if cluster.isalpha() and any(letter in cluster for letter in letters):
                return arg
            if not cluster.isalpha() and cluster[0] in letters:
                return arg  # the flag with its value attached (pip -ihttps://...)
    return None


def _abbreviates(arg: str, long: str) -> bool:
    """Whether ``arg`` is the long option ``long``, a prefix of it, or either with ``=value``.
    A prefix another of the program's options shares too counts: a judge that cannot tell
    takes the stricter reading."""
    name = arg.split("=", 1)[0]
    return len(name) > 2 and name.startswith("--") and long.startswith(name)


# Where an allowlist's programs are looked for, and the folders of the helpers a program
# execs by their own path (git's exec-path: git-remote-https, git-submodule): a listed
# program's helpers are listed with it, under their own names (git-x is git's: rule_names).
ALLOW_FOLDERS = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")
HELPER_FOLDERS = {"git": ("/usr/lib/git-core",)}
# The ELF loaders the kernel runs for each dynamic program: always run under an allowlist.
LOADER_FILES = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1", "/lib/ld-linux.so.2")


def allowlisted(
    programs: "Iterable[str]",
    root: str,
    resolve: "Callable[[str], str]",
    folders: "Sequence[str]" = ALLOW_FOLDERS,
) -> "Tuple[Dict[str, List[str]], List[str]]":
    """What an allowlist of ``programs`` (its rules' program globs) lets run, in the image at
    ``root`` ("" for the one we run in), each file by its path there with every link followed
    (``resolve``): (listed, needed). ``listed``: the files of the programs it names, in the
    program folders and the helper folders of the programs named (``HELPER_FOLDERS``), each
    with the names it is listed by there: an exec is allowed by what its file is, never by
    the name it was given. ``needed``: what they need to run besides, run only for them (the
    exec judge judges none of them as listed): the interpreters their scripts name (X too
    for ``#!/usr/bin/env X``, found in the program folders) and the ELF loaders. The one list
    the host's view, Landlock and the exec judge all take. ``folders``: where programs are
    looked for."""
    import os

    globs = sorted(set(programs))
    listed: "Dict[str, List[str]]" = {}
    looked = [(folder, False) for folder in folders]
    looked += [
        (helper, True)
        for name, helpers in sorted(HELPER_FOLDERS.items())
        if any(execruns.glob(name, g) for g in globs)
        for helper in helpers
    ]
    for folder, helper in looked:
        try:
            names = sorted(os.listdir(root + folder))
        except OSError:
            continue
        for name in names:
            filed = rule_names(name) if helper else (name,)
            if any(execruns.glob(n, g) for n in filed for g in globs):
                found = listed.setdefault(resolve(f"{folder}/{name}"), [])
                if name not in found:
                    found.append(name)
    needed: "Set[str]" = set()
    for path in listed:
        try:
            with open(root + path, "rb") as fh:
                head = fh.read(execruns.SCRIPT_HEAD)
        except OSError:
            continue
        script = execruns.interpreted(head, path, [])
        if script is None:
            continue
        needed.add(resolve(script[0]))
        runs = execruns.env_runs(head)
        if runs is None:
            continue
        places = [runs[0]] if runs[0].startswith("/") else [f"{folder}/{runs[0]}" for folder in ALLOW_FOLDERS]
        needed.update(resolve(place) for place in places)
    needed.update(resolve(loader) for loader in LOADER_FILES)
    return listed, sorted(path for path in needed - set(listed) if os.path.exists(root + path))


def run_as(names: "Iterable[str]", argv0: str) -> "List[str]":
    """The names a file the allowlist lists by ``names`` runs as when exec'd with ``argv0``:
    a program run by one of them picks its command from argv[0], never from the path it was
    run by nor another name of its file (/usr/lib/git-core/git, listed as git-status too, is
    `git init x` given argv ``git init x``, and `git status` given ``git-status``), and git
    by ``git-X`` runs its command X (``rule_names``). Given no name of its, the file is its
    own program: its names that are no other's command (``git``, not ``git-status``)."""
    names = list(names)
    given = execruns.program(argv0)
    if given in names or (given.startswith("git-") and len(given) > 4 and "git" in names):
        return [given]
    own = [name for name in names if len(pattern([name])) == 1]
    return own or names


def _operative(name: str, args: "Sequence[str]") -> "Tuple[str, List[str], List[str]]":
    """``args`` read as ``name`` reads them: what runs (``-m`` and a module, a script, git's
    command: the first word of the tail) apart from the options before it (the head).
    Python's command line as ``execruns.command_line`` reads it (``"-c"``: code given as text, or
    standard input); git's past its global options (``"?"``: unsure where its command is);
    npm's past its options (``"?"`` likewise); any other program's words are all tail."""
    if name.startswith("python"):
        run = execruns.command_line([name, *args])
        if run is None:
            return "-c", list(args), []
        kind, tail = run
        head = list(args[: len(args) - len(tail) + (1 if kind == "-m" else 0)])
        if kind == "-m":  # the words that name the module are no option to compare
            head = head[:-2] if head[-2:] == ["-m", tail[0]] else head[:-1]
            # a package's __main__ is what -m runs of the package: ``-m pytest.__main__`` is
            # ``-m pytest`` (another submodule is other code)
            if tail[0].endswith(".__main__"):
                tail = [tail[0][: -len(".__main__")], *tail[1:]]
        return kind, head, tail
    if name == "git" and args:
        at = execgit.git_command_at(args)
        if at is None:
            return "?", list(args), []
        return "git", list(args[:at]), list(args[at:])
    if name == "npm" and args:
        at = execnpm.npm_command_at(args)
        if at is None:
            return "?", list(args), []
        return "npm", [a for a in args[:at] if a != "--"], list(args[at:])
    return "", [], list(args)


def _carried_surely(name: str, flag: str, args: "Sequence[str]") -> "Optional[bool]":
    """Whether ``args`` carry ``flag`` as an option, not as another option's value: in a word
    that follows no option (any option may take the next word), alone or first in its
    cluster (``-xr``: ``-x`` may take ``r``). None: only where it may be a value."""
    if _carrier(name, flag, args) is None:
        return False
    after_option = False
    for at, arg in enumerate(args):
        if arg == "--":
            break
        if not after_option and _carrier(name, flag, [arg]) is not None:
            if not arg.startswith("-") or arg.startswith("--") or len(arg) == 2:
                return True
            if _carrier(name, flag, [arg[:2]]) is not None:
                return True
        after_option = _may_take_value(name, arg)
    return None


def _may_take_value(name: str, arg: str) -> bool:
    """Whether ``arg`` is an option that may take the next word as its value: any but
    ``--option=value`` and, for npm, the options it knows take none (``npm -s test``)."""
    if not (arg.startswith("-") and len(arg) > 1) or (arg.startswith("--") and "=" in arg):
        return False
    return not execnpm.npm_flag(arg) if name == "npm" else True


def _leads(name: str, words: "Sequence[str]", args: "Sequence[str]") -> "Optional[bool]":
    """Whether the words ``words`` are the leading operands of ``args``, in order: the words
    no option that come first, where no word may be an option's value (a word after an
    option this cannot tell takes none: unsure, None, as far as it goes)."""
    leading: "List[str]" = []
    sure, ended, after_option = True, False, False
    for arg in args:
        if len(leading) >= len(words):
            break
        if not ended and arg == "--":
            ended, after_option = True, False
        elif not ended and arg.startswith("-") and len(arg) > 1:
            after_option = _may_take_value(name, arg)
        elif after_option and not ended:
            sure = False  # it, and what follows, may sit one word off
            break
        else:
            leading.append(arg)
    for word, arg in zip(words, leading):
        if not execruns.glob(arg, word):
            return False
    return True if len(leading) >= len(words) else (None if not sure else False)


def _tail_reads_as(name: str, words: "Sequence[str]", args: "Sequence[str]") -> "Optional[bool]":
    """Whether ``args`` (a program's words past what it runs) carry the rule's ``words`` as
    the rule means them: its words no option as the leading operands, its flags as options."""
    if len(words) <= len(args) and all(execruns.glob(a, w) for w, a in zip(words, args)):
        return True  # the rule's words themselves, however its options read: what it names
    found: "Optional[bool]" = True
    for word in words:
        if word.startswith("-"):
            for flag in _flags(name, word):
                carried = _carried_surely(name, flag, args)
                if carried is False:
                    return False
                found = None if carried is None else found
    leads = _leads(name, [w for w in words if not w.startswith("-")], args)
    return leads if leads is not True else found


def reads_as(words: "Sequence[str]", command: "Sequence[str]") -> "Optional[bool]":
    """Whether ``command`` does what the rule ``words`` names, read as its program reads its
    command line: python's module (``-m``) or script, nothing given as code (``-c``); git's
    command at git's command position, past its global options and their values; npm's past
    its options that take none (``npm -s t`` is ``npm test``); then, as
    for any other program, the rule's words no option as the command's leading operands, in
    order (an option's value never counts), and its flags as options. None: unsure where the
    reading meets an option it does not know (that may take a value)."""
    named = _named(words, command)
    if named is None:
        return False
    words, command, name = named
    if len(words) == 1:
        return True
    kind, head, tail = _operative(name, command[1:])
    wants, wanted_head, wanted = _operative(name, words[1:])
    if wants in ("", "-c") or (wants in ("git", "npm") and kind == wants and not wanted):
        # a rule over the program's own options (``python3 -X``, ``git --version``)
        return _tail_reads_as(name, words[1:], command[1:])
    if kind == "?":
        return None
    if kind != wants or not tail:
        return False
    if kind == "git" and tail[0] not in execgit.GIT_COMMANDS:
        return None  # an alias (or a typo autocorrected): it may run anything
    if not execruns.glob(tail[0], wanted[0]):
        return False
    if any(word not in head for word in wanted_head):
        return False
    return _tail_reads_as(tail[0] if kind == "-m" else name, wanted[1:], tail[1:])


def allows(words: "Sequence[str]", command: "Sequence[str]") -> bool:
    """Whether the allow rule ``words`` lets ``command`` run: only where it surely does what
    the rule names (``reads_as``). ``python3 -c CODE -m pytest`` is no ``python3 -m pytest``:
    the code runs first; nor is ``git -C status commit`` a ``git status``."""
    return reads_as(words, command) is True


def matches(words: "Sequence[str]", command: "Sequence[str]") -> bool:
    """Whether the simple command ``command`` may be what the pattern ``words`` names, for a
    deny or an approve rule: read loosely (a flag anywhere, a rule's word among any operands,
    an option's value too), which errs toward asking, or as its program reads it
    (``reads_as``: ``python3 -Impip`` is a ``python3 -m pip``). An allow rule is ``allows``."""
    return _loosely(words, command) or reads_as(words, command) is True


def _named(words: "Sequence[str]", command: "Sequence[str]") -> "Optional[Tuple[List[str], List[str], str]]":
    """The rule's words and the command as they are matched (``pattern``, ``_dashed``), and
    the name the command's program goes by that the rule's program is; None: another program."""
    if not command or not words:
        return None
    words, command = pattern(words), _dashed(command)
    name = next((n for n in rule_names(execruns.program(command[0])) if execruns.glob(n, words[0])), None)
    return None if name is None else (words, command, name)


def _loosely(words: "Sequence[str]", command: "Sequence[str]") -> bool:
    named = _named(words, command)
    if named is None:
        return False
    words, command, name = named
    args = list(command[1:])
    if name == "git" and len(words) > 1 and execgit.git_alias(args):
        return True  # an alias may stand for the rule's command: judged as it
    try:
        operands = args[args.index("--") + 1 :]
        options = args[: args.index("--")]
    except ValueError:
        operands, options = [], args
    positional = [a for a in options if not a.startswith("-")] + operands
    if name == "npm":
        positional += execnpm.npm_implied(args)
    for word in words[1:]:
        if word.startswith("-"):
            if not all(_carries(name, flag, args) for flag in _flags(name, word)):
                return False
        elif not any(execruns.glob(a, word) for a in positional):
            return False
    return True


def judged_words(words: "Sequence[str]", argv: "Sequence[str]") -> "List[str]":
    """The words of ``argv`` that the pattern ``words`` matched it by: for each of its flags
    the first argument carrying it, for each other word the first argument it names. An
    approver shown an argv cut to its bounds must see these (``rm <62 files> -r src``
    was shown without its ``-r``, under the rule ``rm -r``). Read over the whole argv, so
    that what a loader or an interpreter runs (a tail of it) is found in it too."""
    words = pattern(words)
    if not words or not argv:
        return []
    found: "List[str]" = []
    args = list(argv[1:])
    name = next((n for n in rule_names(execruns.program(argv[0])) if execruns.glob(n, words[0])), None)
    if name is None:  # a program run by another (ld.so /bin/rm, python3 -m pip): the word naming it
        for arg in args:
            names = rule_names(execruns.program(arg).split(".", 1)[0])
            name = next((n for n in names if execruns.glob(n, words[0])), None)
            if name is not None:
                found.append(arg)
                break
    name = name or execruns.program(argv[0])
    try:
        operands, options = args[args.index("--") + 1 :], args[: args.index("--")]
    except ValueError:
        operands, options = [], args
    positional = [a for a in options if not a.startswith("-")] + operands
    for word in words[1:]:
        if word.startswith("-"):
            hits = [_carrier(name, flag, args) for flag in _flags(name, word)]
        else:
            slots = execnpm.npm_slots(args) if name == "npm" else []
            named = (args[at] for at in slots if execnpm.npm_names(name, args, at, word))
            hits = [next((a for a in positional if execruns.glob(a, word)), next(named, None))]
        found += [hit for hit in hits if hit is not None and hit not in found]
    return found


def judge(rules: "Dict[str, List[List[str]]]", argv: "Sequence[str]") -> "Tuple[str, Optional[str]]":
    """The verdict on one exec: ``("deny", rule)``, ``("approve", rule)`` or ``("allow", None)``.

    ``rules`` maps ``deny``/``approve``/``allow`` to patterns as word lists; a non-empty
    ``allow`` lets only what it names run. Deny beats the allowlist beats approve.
    """
    command = execruns.subject(argv)
    for words in rules.get("deny", ()):
        if matches(words, command):
            return "deny", "commands.deny: " + " ".join(words)
    allow = rules.get("allow", ())
    if allow and not any(allows(words, argv) or allows(words, command) for words in allow):
        return "deny", "commands.allow"
    for words in rules.get("approve", ()):
        if matches(words, command):
            return "approve", "commands.approve: " + " ".join(words)
    return "allow", None


def programs(patterns: "Sequence[Sequence[str]]") -> "FrozenSet[str]":
    """The program globs of single-word patterns: what is denied whatever its arguments."""
    return frozenset(words[0] for words in patterns if len(words) == 1)


def build_id(path: str) -> "Optional[bytes]":
    """The GNU build ID of a 64-bit little-endian ELF file (its NT_GNU_BUILD_ID note), if any:
    a copy keeps it when bytes are added or changed elsewhere. The exec judge compares it, and
    the host reads it of the programs it masks. ``OSError`` where the file cannot be read as
    far as it goes."""
    import os
    import struct

    # without waiting: a lease the code holds on it makes this fail (EWOULDBLOCK)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        size = os.fstat(fd).st_size

        def read(count: int, at: int) -> bytes:
            want = max(0, min(count, size - at))
            got = os.pread(fd, want, at) if want else b""
            if len(got) < want:
                raise OSError(5, "a short read")  # EIO
            return got

        head = read(64, 0)
        if len(head) < 64 or head[:6] != b"\x7fELF\x02\x01":
            return None
        (phoff,) = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        if phentsize < 56 or phnum > 256:
            return None
        table = read(phentsize * phnum, phoff)
        for i in range(len(table) // phentsize):
            (kind,) = struct.unpack_from("<I", table, i * phentsize)
            if kind != 4:  # PT_NOTE
                continue
            (offset,) = struct.unpack_from("<Q", table, i * phentsize + 8)
            (note_size,) = struct.unpack_from("<Q", table, i * phentsize + 32)
            notes = read(min(note_size, 1 << 16), offset)
            at = 0
            while at + 12 <= len(notes):
                namesz, descsz, note = struct.unpack_from("<III", notes, at)
                name_at = at + 12
                desc_at = name_at + (namesz + 3) // 4 * 4
                if note == 3 and notes[name_at : name_at + namesz] == b"GNU\0":
                    return notes[desc_at : desc_at + descsz] or None
                at = desc_at + (descsz + 3) // 4 * 4
    except struct.error:
        return None
    finally:
        os.close(fd)
    return None

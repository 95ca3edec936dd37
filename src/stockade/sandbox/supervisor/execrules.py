"""Command rules over one program's argv: whether ``rm -fR build`` is ``rm -r``.

One implementation for both sides: the host's policy judges the commands a tool call names
with it, and the supervisor judges every exec inside the sandbox with it, when it happens,
with the argv the kernel was given. Standard library only (it runs inside the sandbox).

A pattern is shell words: the program (a glob over its name), then flags the command must
carry and words that must be among its other arguments: ``"rm -r"``, ``"git push"``,
``"pip install"``. A flag matches its spellings for that program: ``rm -fR``, ``rm -r -f``,
``rm --recursive`` and its abbreviations (``rm --recu``: GNU getopt, git's and Python's
option parsers take any unambiguous prefix) all carry ``-r``.
"""

from __future__ import annotations

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


GLOB_CHARS = frozenset("*?[")
# git's own commands (git 2.39, ``git --list-cmds=main``). An alias cannot shadow one of
# them; any other word in their place may be an alias the code defined (``-c alias.x=push``,
# a config file, the environment), which runs a command no argv shows, so a rule over git
# takes it for its own command (a git newer than this list: the same, the safe way).
GIT_COMMANDS = frozenset(
    """
    add add--interactive am annotate apply archive bisect bisect--helper blame branch bugreport
    bundle cat-file check-attr check-ignore check-mailmap check-ref-format checkout
    checkout--worker checkout-index cherry cherry-pick clean clone column commit commit-graph
    commit-tree config count-objects credential credential-cache credential-cache--daemon
    credential-store daemon describe diagnose diff diff-files diff-index diff-tree difftool
    difftool--helper env--helper fast-export fast-import fetch fetch-pack filter-branch
    fmt-merge-msg for-each-ref for-each-repo format-patch fsck fsck-objects fsmonitor--daemon gc
    get-tar-commit-id grep hash-object help hook http-backend http-fetch http-push imap-send
    index-pack init init-db instaweb interpret-trailers log ls-files ls-remote ls-tree mailinfo
    mailsplit maintenance merge merge-base merge-file merge-index merge-octopus merge-one-file
    merge-ours merge-recursive merge-recursive-ours merge-recursive-theirs merge-resolve
    merge-subtree merge-tree mergetool mktag mktree multi-pack-index mv name-rev notes
    pack-objects pack-redundant pack-refs patch-id pickaxe prune prune-packed pull push
    quiltimport range-diff read-tree rebase receive-pack reflog remote remote-ext remote-fd
    remote-ftp remote-ftps remote-http remote-https repack replace request-pull rerere reset
    restore rev-list rev-parse revert rm send-pack sh-i18n--envsubst shell shortlog show
    show-branch show-index show-ref sparse-checkout stage stash status stripspace submodule
    submodule--helper subtree switch symbolic-ref tag unpack-file unpack-objects update-index
    update-ref update-server-info upload-archive upload-archive--writer upload-pack var
    verify-commit verify-pack verify-tag version web--browse whatchanged worktree write-tree
    """.split()
)
# git's plumbing commands that do what a porcelain command does (a rule over the porcelain
# holds for them too); a word so named anywhere in git's arguments is read as the command.
GIT_PLUMBING = {"send-pack": "push", "http-push": "push"}
# git's options before its command that take the next word as their value.
# git's options before its command that take the next word as their value (git.c's
# handle_options), and those that take none: any other may take one in a git of another
# version, so the command may be either of the two words after it (_git_alias).
GIT_VALUED = frozenset(
    """
    -C -c --git-dir --work-tree --namespace --super-prefix --config-env --shallow-file --attr-source
    """.split()
)
GIT_FLAGS = frozenset(
    """
    -p --paginate -P --no-pager --no-replace-objects --bare --literal-pathspecs --glob-pathspecs
    --noglob-pathspecs --icase-pathspecs --no-optional-locks --no-lazy-fetch --no-advice
    --html-path --man-path --info-path --exec-path -v --version -h --help
    """.split()
)


# npm's commands and its other spellings of them (npm 11, lib/utils/cmd-list.js): npm runs
# the command its word names exactly, or an alias, or any prefix of one of either that no
# other shares (``npm insta``, ``npm install-cl``: ``ci``), or a camelCase one (``installTest``).
NPM_COMMANDS = frozenset(
    """
    access adduser approve-scripts audit bugs cache ci completion config dedupe deny-scripts
    deprecate diff dist-tag docs doctor edit exec explain explore find-dupes fund get help
    help-search init install install-ci-test install-scripts install-test link ll login logout
    ls org outdated owner pack ping pkg prefix profile prune publish query rebuild repo restart
    root run sbom search set shrinkwrap stage star stars start stop team test token trust
    undeprecate uninstall unpublish unstar update version view whoami
    """.split()
)
NPM_ALIASES = {
    "author": "owner", "home": "docs", "issues": "bugs", "info": "view", "show": "view",
    "find": "search", "add": "install", "unlink": "uninstall", "remove": "uninstall",
    "rm": "uninstall", "r": "uninstall", "un": "uninstall", "rb": "rebuild", "list": "ls",
    "ln": "link", "create": "init", "i": "install", "it": "install-test", "cit": "install-ci-test",
    "u": "update", "up": "update", "c": "config", "s": "search", "se": "search", "tst": "test",
    "t": "test", "ddp": "dedupe", "v": "view", "run-script": "run", "clean-install": "ci",
    "clean-install-test": "install-ci-test", "x": "exec", "why": "explain", "la": "ll",
    "verison": "version", "ic": "ci", "innit": "init", "in": "install", "ins": "install",
    "inst": "install", "insta": "install", "instal": "install", "isnt": "install",
    "isnta": "install", "isntal": "install", "isntall": "install", "install-clean": "ci",
    "isntall-clean": "ci", "hlep": "help", "dist-tags": "dist-tag", "upgrade": "update",
    "udpate": "update", "rum": "run", "sit": "install-ci-test", "urn": "run", "ogr": "org",
    "add-user": "adduser",
}  # fmt: skip
# npm's commands that install packages as `npm install` does: they reify node_modules (a
# clean install, an install before the tests, an update, a dedupe, a prune, an uninstall and
# a link: npm reifies the tree left, adding what it lacks and running its lifecycle scripts),
# run the installed packages' install scripts (rebuild, and edit: it rebuilds what it edited),
# or install the package they run if it is missing (exec). A rule over `npm install` holds for
# them too. Not the other way: `npm ci` is not `install`.
NPM_INSTALLS = frozenset(
    "ci install-test install-ci-test update dedupe prune uninstall link rebuild edit exec".split()
)
# And those that do given an operand (any word no option after the command: an option's
# value may be taken for one, which errs toward asking): ``audit fix`` (a bare audit reports),
# ``cache add x``, ``init x`` (``npm exec create-x``; bare, it writes a package.json, but into
# a workspace it reifies: ``NPM_WORKSPACE``), ``pack x`` and ``publish x`` (npm fetches what x
# names, and a git package with a prepare script is installed, its dependencies and scripts,
# to be packed; a folder's prepare script runs). A bare ``pack``/``publish`` runs the project's
# own prepack/prepare scripts, its own code as ``npm run`` does: no install. None: any operand.
# ``diff --diff=SPEC`` fetches what SPEC names to compare it, as ``pack x`` does (a git one is
# installed and prepared first); a bare ``diff`` compares with the registry's tarball.
NPM_INSTALLS_GIVEN = {
    "audit": "fix", "cache": "add", "init": None, "pack": None, "publish": None, "diff": "--diff",
}  # type: Dict[str, Optional[str]]  # fmt: skip
# npm's options that take no value (npm 11's config definitions whose type is Boolean, and
# their shorthands; ``--no-X`` and ``--X=value`` hold their own). Any other may take the next
# word: npm reads an option it does not know as a flag, but a newer npm may know it.
NPM_FLAGS = frozenset(
    """
    all allow-same-version allow-scripts-pending allow-scripts-pin audit bin-links browser
    bypass-2fa color commit-hooks dangerously-allow-all-scripts description dev
    diff-ignore-all-space diff-name-only diff-no-prefix diff-text dry-run engine-strict
    expect-results force foreground-scripts format-package-lock fund git-tag-version global
    global-style if-present ignore-scripts include-attestations include-staged
    include-workspace-root init-private install-links json legacy-bundling legacy-peer-deps link
    long offline omit-lockfile-registry-resolved optional package-lock package-lock-only
    packages-all parseable prefer-dedupe prefer-offline prefer-online production progress
    provenance read-only rebuild-bundle save save-bundle save-dev save-exact save-optional
    save-peer save-prod shrinkwrap sign-git-commit sign-git-tag strict-allow-scripts
    strict-peer-deps strict-ssl timing unicode update-notifier usage version versions workspaces
    workspaces-update yes quiet silent verbose local porcelain readonly iwr ws help no desc
    """.split()
)
NPM_SHORT_FLAGS = frozenset("aBdDEfghHlnOpPqsSvy?")
# Programs that are another program's command under a name of their own: ``npx`` is ``npm
# exec`` (a rule over either holds over both, as ``git-push`` is ``git push``).
SHORTHANDS = {"npx": ("npm", "exec")}


def npm_command(word: str) -> "Optional[str]":
    """The npm command ``word`` runs, as npm reads it (cmd-list.js's deref), or None."""
    if any("A" <= c <= "Z" for c in word):  # installTest is install-test
        word = "".join("-" + c.lower() if "A" <= c <= "Z" else c for c in word)
    if word in NPM_COMMANDS:
        return word
    if word in NPM_ALIASES:
        return NPM_ALIASES[word]
    named = [name for name in (*NPM_COMMANDS, *NPM_ALIASES) if name.startswith(word)]
    if len(named) != 1 or not word:
        return None  # no command, or a prefix of several: npm runs none of them
    return NPM_ALIASES.get(named[0], named[0])


def _npm_slots(args: "Sequence[str]") -> "List[int]":
    """Where in npm's ``args`` its command may be: the first word that is no option, and each
    one after an option (its value, or the command after an option that takes none): npm's
    options are many and change, so each reading is judged, which errs on the side of asking
    (as ``scripts`` reads an interpreter's command line)."""
    slots: "List[int]" = []
    after_option = False
    for at, word in enumerate(args):
        if word == "--":
            return slots + ([at + 1] if at + 1 < len(args) else [])
        if len(word) > 1 and word[0] == "-":
            after_option = not _npm_flag(word)
            continue
        slots.append(at)
        if not after_option:
            break
        after_option = False
    return slots


def _npm_flag(word: str) -> bool:
    """Whether npm's option ``word`` takes no value from the next word."""
    if word.startswith("--"):
        return "=" in word or word.startswith("--no-") or word[2:] in NPM_FLAGS
    return all(letter in NPM_SHORT_FLAGS for letter in word[1:])


def npm_implied(args: "Sequence[str]") -> "List[str]":
    """The commands besides its own that an npm command line runs (``npm_installs``): a
    rule's word matches these too (``npm ci`` installs: a rule over ``npm install`` holds)."""
    return ["install" for at in _npm_slots(args) if npm_installs(args, at)]


def npm_installs(args: "Sequence[str]", at: int) -> bool:
    """Whether npm's ``args``, its command at ``at``, install as ``npm install`` does
    (``NPM_INSTALLS``, ``NPM_INSTALLS_GIVEN``)."""
    command = npm_command(args[at])
    if command in NPM_INSTALLS:
        return True
    if command not in NPM_INSTALLS_GIVEN:
        return False
    rest = args[at + 1 :]
    ended = rest.index("--") if "--" in rest else len(rest)
    if command == "diff":  # what a --diff names is fetched: a git one is installed and prepared
        return any(w == "--diff" or w.startswith("--diff=") for w in args[:at] + rest[:ended])
    operands = [w for w in rest[:ended] if not (len(w) > 1 and w[0] == "-")] + list(rest[ended + 1 :])
    wanted = NPM_INSTALLS_GIVEN[command]
    if command == "init" and any(_npm_workspace(word) for word in args[:at] + rest[:ended]):
        return True
    return wanted in operands if wanted is not None else bool(operands)


def _npm_workspace(word: str) -> bool:
    """Whether npm's option ``word`` may be a workspace one (``-w x``, ``--workspaces``, or a
    prefix npm takes of either: ``--worksp``; ``--no-workspaces-update`` is no workspace)."""
    if word.startswith("--"):
        return word[2:].startswith("w")
    return len(word) > 1 and word[0] == "-" and "w" in word[1:]


def _npm_names(name: str, args: "Sequence[str]", at: int, word: str) -> bool:
    """Whether npm's ``args[at]`` is another spelling of the rule's ``word`` (``add``:
    ``install``), or a command that installs as it does (``npm_installs``)."""
    if name != "npm":
        return False
    command = npm_command(args[at])
    return command is not None and (command == word or (word == "install" and npm_installs(args, at)))


def program(word: str) -> str:
    return word.rsplit("/", 1)[-1]


def _glob(name: str, pattern: str) -> bool:
    """fnmatch, imported only for a pattern that is one (fnmatch imports re: milliseconds)."""
    if not GLOB_CHARS & set(pattern):
        return name == pattern
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


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
    if name in SHORTHANDS:
        names.append(SHORTHANDS[name][0])
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
    name = program(command[0])
    if name.startswith("git-") and len(name) > 4:
        command = ["git", name[4:], *command[1:]]
    if program(command[0]) == "git":
        return [command[0], *(GIT_PLUMBING.get(word, word) for word in command[1:])]
    if program(command[0]) in SHORTHANDS:  # npx x is npm exec x
        command = [*SHORTHANDS[program(command[0])], *command[1:]]
    if program(command[0]) == "npm":  # npm add x, npm isntall x: npm install x
        args = list(command[1:])
        for at in _npm_slots(args):
            args[at] = npm_command(args[at]) or args[at]
        return [command[0], *args]
    return list(command)


SHELLS = ("sh", "bash", "dash", "ash", "ksh", "zsh")
# Interpreters whose command lines are not read here word by word: any word may be the script
# they run (``scripts``). ``node /usr/bin/npm install`` ran npm past an `npm install` rule.
OTHER_INTERPRETERS = (
    "node",
    "nodejs",
    "perl*",
    "ruby*",
    "php*",
    "tclsh*",
    "wish*",
    "lua*",
    "luajit*",
    "Rscript",
)
# The programs that run a script file they are given (globs, as judge.c reads them): an exec
# of one with arguments is Python's to judge.
INTERPRETERS = ("python*", *SHELLS, *OTHER_INTERPRETERS)
# Their files, by the names the image gives them: a copy of one under another name (./py -m
# pip) is known by its content, as a copy of a rule's program is, and read as the interpreter.
INTERPRETER_FILES = (
    "python3", "python", *SHELLS, "node", "nodejs", "perl", "ruby", "php", "tclsh", "wish", "lua", "luajit",
    "Rscript",
)  # fmt: skip

# Folders of the image: code can write none of them (a file there is what the image shipped).
IMAGE_FOLDERS = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib32/", "/lib64/", "/libx32/", "/opt/")


def in_image(path: str) -> bool:
    return path.startswith(IMAGE_FOLDERS)


# How each interpreter reads its command line, as its getopt does: the options that end the
# options with code in no file (python -c CODE; sh -c, -s), the one that names a module
# (python -m MODULE), those that take a value, attached (-Wignore, -mpip) or as the next word,
# the long ones that take the next word, and what an option starts with. CPython's list is
# Python/getopt.c's SHORT_OPTS ("bBc:dEhiIm:OPqRsStuvVW:xX:?"): an option it does not know
# ends the run with an error, so reading one as a flag lets nothing run unread.
PYTHON_OPTIONS = ("c", "m", "WX", ("--check-hash-based-pycs",), "-")
SHELL_OPTIONS = ("cs", "", "oO", ("--rcfile", "--init-file"), "-+")  # bash -O extglob, +O


def command_line(argv: "Sequence[str]") -> "Optional[Tuple[str, List[str]]]":
    """What an interpreter's command line runs, read as the interpreter reads it: ``("-m",
    [module, *args])`` for ``python3 -Impip x`` (short options combine; -c, -m, -W, -X take
    a value, attached or the next word; ``--`` ends the options), ``("script", [path, *args])``
    for the first word that is no option (``python3 -X dev /usr/bin/pip x``). None: not an
    interpreter, or code that is no file nor module (``-c``, standard input)."""
    name = program(argv[0]) if argv else ""
    if name.startswith("python"):  # INTERPRETERS: each one known here
        stops, module_letter, valued, long_valued, signs = PYTHON_OPTIONS
    elif name in SHELLS:
        stops, module_letter, valued, long_valued, signs = SHELL_OPTIONS
    else:
        return None
    at = 1
    while at < len(argv):
        word = argv[at]
        if word == "--":
            at += 1
            break
        if word.startswith("--"):
            at += 2 if word in long_valued else 1
            continue
        if len(word) < 2 or word[0] not in signs:
            break
        step = 1
        for i in range(1, len(word)):
            letter = word[i]
            if letter in stops:
                return None  # code given as text, or read from standard input
            if letter == module_letter:
                attached = word[i + 1 :]
                module = attached if attached else (argv[at + 1] if at + 1 < len(argv) else None)
                if module is None:
                    return None  # python3 -m with no module: an error, nothing runs
                return "-m", [module, *argv[at + (1 if attached else 2) :]]
            if letter in valued:  # -W arg, -X dev; -Wignore holds its own (the rest is its value)
                step = 1 if word[i + 1 :] else 2
                break
        at += step
    if at >= len(argv) or argv[at] == "-":
        return None
    return "script", list(argv[at:])


def subject(argv: "Sequence[str]") -> "List[str]":
    """What a command runs: ``python3 -m pip install x`` (or ``-Impip``, ``-m pip.__main__``)
    runs ``pip install x``: the module's top-level package, which rules name as a program."""
    run = command_line(argv)
    if run is not None and run[0] == "-m":
        return [run[1][0].split(".", 1)[0], *run[1][1:]]
    return list(argv)


def script_run(argv: "Sequence[str]") -> "Optional[List[str]]":
    """The script an interpreter is given to run, as the command it is: ``python3 /usr/bin/pip
    install x`` runs ``pip install x``, as ``/usr/bin/pip install x`` would (the kernel runs
    it so for its ``#!`` line). None: no script file (``-c``, ``-m``, standard input)."""
    run = command_line(argv)
    return run[1] if run is not None and run[0] == "script" else None


# The words that may be an interpreter's script (``scripts``), and the folders of a Python
# script's path read as programs (``runs``), judged at most: each is a copy of the argv's
# rest, so a command of N options made N copies of N words (50 KB of `node -r x -r x ...`
# took 65 s and 2.3 GB of the host's policy check, and ran the sandbox's judge out of memory:
# found from outside). Past the cap a command is not read, and is refused.
MAX_SCRIPTS = 32


class TooMany(ValueError):
    """More words may be what an interpreter runs than are judged (``MAX_SCRIPTS``)."""


def scripts(argv: "Sequence[str]") -> "List[List[str]]":
    """The script files an interpreter's ``argv`` may run, each with its arguments: Python's
    and a shell's as they read their command line; another interpreter's (node, perl, ruby:
    ``OTHER_INTERPRETERS``), whose options are not known here, every word that may be its
    script: each word no option that follows an option (it may be the option's value, or the
    script after an option that takes none) and the first that does not (the script, if no
    word before was). Options come before the script in each of them, so the script is one
    of these whichever options take a value; the others are judged too, which errs on the
    side of asking (``perl -e CODE rm -r x`` is judged as ``rm -r x``: it may well run it).
    ``TooMany`` past ``MAX_SCRIPTS`` of them."""
    name = program(argv[0]) if argv else ""
    if not any(_glob(name, other) for other in OTHER_INTERPRETERS):
        run = script_run(argv)
        return [run] if run is not None else []
    found: "List[List[str]]" = []
    after_option = False
    for at in range(1, len(argv)):
        word = argv[at]
        if word == "--":
            return found + ([list(argv[at + 1 :])] if at + 1 < len(argv) else [])
        if len(word) > 1 and word[0] == "-":
            after_option = True
            continue
        if len(found) == MAX_SCRIPTS:
            raise TooMany(f"more than {MAX_SCRIPTS} words of {name}'s command line may be the script it runs")
        found.append(list(argv[at:]))
        if not after_option:
            break
        after_option = False
    return found


def runs(argv: "Sequence[str]") -> "List[List[str]]":
    """Each command an interpreter's ``argv`` runs, as a program the rules name: a module as
    its top-level package (``python3 -m pip.__main__ x``: ``pip x``); a script by its name
    and, for Python, by its name without its suffix and by every folder on its path (a
    package's ``__main__.py``, the package's folder itself, a file in it: ``python3
    .../pip/__main__.py x`` and ``python3 .../pip x`` are ``pip x``; ``python3 pip.pyz x`` is
    too; the last ``MAX_SCRIPTS`` folders of its path). Empty: the interpreter runs no file
    nor module (``-c``), or is none. ``TooMany``: see ``scripts``."""
    run = command_line(argv)
    if run is None:
        return [[program(script[0]), *script[1:]] for script in scripts(argv)]
    target, args = run[1][0], run[1][1:]
    if run[0] == "-m":
        return [[target.split(".", 1)[0], *args]]
    found = [[target, *args]]
    if program(argv[0]).startswith("python"):
        *folders, name = target.split("/")
        stem = name.split(".", 1)[0]
        words = dict.fromkeys(
            w for w in (stem, *folders[-MAX_SCRIPTS:]) if w not in ("", ".", "..", name, target)
        )
        found += [[word, *args] for word in words]
    return found


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


# Programs that run another program their arguments name: the dynamic loader, run as a program
# (``ld.so [--argv0 NAME] [OPTIONS] PROGRAM ARGS``), and multi-call binaries, run by their own
# name (``busybox APPLET ARGS``; by an applet's name, the applet is their argv[0]).
LOADERS = ("ld-linux*", "ld.so*", "ld64.so*", "ld-musl-*")
MULTICALL = ("busybox", "toybox")
# The loader's options that take a value (glibc's ld.so --help); any other is a flag.
LOADER_VALUED = frozenset(
    ("--argv0", "--library-path", "--preload", "--audit", "--inhibit-rpath",
     "--glibc-hwcaps-prepend", "--glibc-hwcaps-mask")
)  # fmt: skip


def carried(names: "Sequence[str]", argv: "Sequence[str]") -> "Optional[Tuple[Optional[str], List[str]]]":
    """What an exec of the program ``names`` (what its file goes by) with ``argv`` runs besides
    itself: the loader's program (its path, and the argv it gets), or a multi-call binary's
    applet (no path: it is the same file). None: nothing."""
    if len(argv) < 2:
        return None
    if program(argv[0]).startswith(MULTICALL):  # busybox reads its applet from argv[0] first
        return None if argv[1].startswith("-") else (None, list(argv[1:]))
    if not any(_glob(name, loader) for name in names for loader in LOADERS):
        return None
    words, at, argv0 = list(argv[1:]), 0, None
    while at < len(words) and words[at].startswith("--"):
        if words[at] == "--":
            at += 1
            break
        if words[at] in LOADER_VALUED:
            if words[at] == "--argv0" and at + 1 < len(words):
                argv0 = words[at + 1]
            at += 2
        else:
            at += 1  # a flag (--list, --verify), or --option=value
    if at >= len(words):
        return None
    path = words[at]
    return path, [path if argv0 is None else argv0, *words[at + 1 :]]


# The kernel reads this much of a file to tell what runs it (BINPRM_BUF_SIZE).
SCRIPT_HEAD = 256


def interpreted(head: bytes, path: str, argv: "Sequence[str]") -> "Optional[Tuple[str, List[str]]]":
    """What the kernel runs for an exec of ``path`` with ``argv`` when the file begins with
    ``head`` (its first ``SCRIPT_HEAD`` bytes) and is a script: its interpreter's path and
    argv, read from the first line as fs/binfmt_script.c reads it (the name up to a space,
    tab or NUL; the rest, trimmed, one argument). No exec is made for the interpreter, so it
    must be judged with the script. None: not a script, or one the kernel refuses."""
    if not head.startswith(b"#!"):
        return None
    end = head.find(b"\n")
    if end < 0:
        rest = head[2 : SCRIPT_HEAD - 1].lstrip(b" \t")
        # No end of line: the kernel takes the whole head only if the name ends in it.
        if not rest or not any(c in rest for c in b" \t\0"):
            return None
        end = SCRIPT_HEAD - 1
    line = head[2:end].rstrip(b" \t").lstrip(b" \t")
    if not line:
        return None
    cut = min((i for i in (line.find(b" "), line.find(b"\t"), line.find(b"\0")) if i >= 0), default=len(line))
    name, rest = line[:cut], line[cut:]
    arg = rest.split(b"\0", 1)[0].lstrip(b" \t") if rest[:1] != b"\0" else b""
    words = [name.decode("utf-8", "surrogateescape")]
    if arg:
        words.append(arg.decode("utf-8", "surrogateescape"))
    return words[0], [*words, path, *argv[1:]]


def env_runs(head: bytes) -> "Optional[List[str]]":
    """What a script whose first line is ``#!/usr/bin/env X`` (or ``env -S "X OPTIONS"``)
    has env run: X and the options it is given before the script's path (env execs
    ``[X, *OPTIONS, script, *args]``). None: no such line, or one env reads otherwise
    (its own options, quotes, escapes: not told here)."""
    script = interpreted(head, "", [])
    if script is None or program(script[0]) != "env" or len(script[1]) != 3:
        return None
    arg = script[1][1]
    if arg.startswith("-S"):
        arg = arg[2:]
    elif any(c in arg for c in " \t"):
        return None  # one name with a space in it: env finds no such program
    words = arg.split()
    while words and "=" in words[0]:  # NAME=VALUE: set, not run
        words.pop(0)
    if not words or words[0].startswith("-") or any(c in arg for c in "\\'\"$"):
        return None
    return words


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
        if any(_glob(name, g) for g in globs)
        for helper in helpers
    ]
    for folder, helper in looked:
        try:
            names = sorted(os.listdir(root + folder))
        except OSError:
            continue
        for name in names:
            filed = rule_names(name) if helper else (name,)
            if any(_glob(n, g) for n in filed for g in globs):
                found = listed.setdefault(resolve(f"{folder}/{name}"), [])
                if name not in found:
                    found.append(name)
    needed: "Set[str]" = set()
    for path in listed:
        try:
            with open(root + path, "rb") as fh:
                head = fh.read(SCRIPT_HEAD)
        except OSError:
            continue
        script = interpreted(head, path, [])
        if script is None:
            continue
        needed.add(resolve(script[0]))
        runs = env_runs(head)
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
    given = program(argv0)
    if given in names or (given.startswith("git-") and len(given) > 4 and "git" in names):
        return [given]
    own = [name for name in names if len(pattern([name])) == 1]
    return own or names


def _git_alias(args: "Sequence[str]") -> bool:
    """Whether git, given ``args``, may run a command that is not one of its own: an alias,
    or a typo that ``help.autocorrect`` runs as the command it resembles, inside git. An
    option this does not know (``--shallow-file`` was missing: its value was taken for the
    command) may take a value: both readings are judged (each start once: no blow-up)."""
    todo, seen = [0], set()
    while todo:
        at = todo.pop()
        while at < len(args) and at not in seen:
            seen.add(at)
            word = args[at]
            if word in GIT_VALUED:
                at += 2
            elif word.startswith("-") and (word in GIT_FLAGS or "=" in word or not word.startswith("--")):
                at += 1
            elif word.startswith("-"):
                todo.append(at + 2)
                at += 1
            else:
                if word not in GIT_COMMANDS:
                    return True
                break
    return False


def _git_command_at(args: "Sequence[str]") -> "Optional[int]":
    """Where git's command is in ``args`` (git's own arguments), read past its global options
    and their values as git.c reads them (``len(args)``: there is none); None where that is
    unsure: an option this does not know, which may take a value."""
    at = 0
    while at < len(args):
        word = args[at]
        if word in GIT_VALUED:
            at += 2
        elif (word.startswith("--") and "=" in word) or word in GIT_FLAGS:
            at += 1
        elif word.startswith("-"):
            return None
        else:
            return at
    return len(args)


def _operative(name: str, args: "Sequence[str]") -> "Tuple[str, List[str], List[str]]":
    """``args`` read as ``name`` reads them: what runs (``-m`` and a module, a script, git's
    command: the first word of the tail) apart from the options before it (the head).
    Python's command line as ``command_line`` reads it (``"-c"``: code given as text, or
    standard input); git's past its global options (``"?"``: unsure where its command is);
    npm's past its options (``"?"`` likewise); any other program's words are all tail."""
    if name.startswith("python"):
        run = command_line([name, *args])
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
        at = _git_command_at(args)
        if at is None:
            return "?", list(args), []
        return "git", list(args[:at]), list(args[at:])
    if name == "npm" and args:
        at = _npm_command_at(args)
        if at is None:
            return "?", list(args), []
        return "npm", [a for a in args[:at] if a != "--"], list(args[at:])
    return "", [], list(args)


def _npm_command_at(args: "Sequence[str]") -> "Optional[int]":
    """Where npm's command is in ``args``, past its options that take no value (``NPM_FLAGS``)
    and a ``--`` (``len(args)``: there is none); None where that is unsure: an option that
    may take a value (``npm --prefix x test``: either word may be the command)."""
    for at, word in enumerate(args):
        if word == "--":
            return at + 1
        if not (len(word) > 1 and word[0] == "-"):
            return at
        if not _npm_flag(word):
            return None
    return len(args)


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
    return not _npm_flag(arg) if name == "npm" else True


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
        if not _glob(arg, word):
            return False
    return True if len(leading) >= len(words) else (None if not sure else False)


def _tail_reads_as(name: str, words: "Sequence[str]", args: "Sequence[str]") -> "Optional[bool]":
    """Whether ``args`` (a program's words past what it runs) carry the rule's ``words`` as
    the rule means them: its words no option as the leading operands, its flags as options."""
    if len(words) <= len(args) and all(_glob(a, w) for w, a in zip(words, args)):
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
    if kind == "git" and tail[0] not in GIT_COMMANDS:
        return None  # an alias (or a typo autocorrected): it may run anything
    if not _glob(tail[0], wanted[0]):
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
    name = next((n for n in rule_names(program(command[0])) if _glob(n, words[0])), None)
    return None if name is None else (words, command, name)


def _loosely(words: "Sequence[str]", command: "Sequence[str]") -> bool:
    named = _named(words, command)
    if named is None:
        return False
    words, command, name = named
    args = list(command[1:])
    if name == "git" and len(words) > 1 and _git_alias(args):
        return True  # an alias may stand for the rule's command: judged as it
    try:
        operands = args[args.index("--") + 1 :]
        options = args[: args.index("--")]
    except ValueError:
        operands, options = [], args
    positional = [a for a in options if not a.startswith("-")] + operands
    if name == "npm":
        positional += npm_implied(args)
    for word in words[1:]:
        if word.startswith("-"):
            if not all(_carries(name, flag, args) for flag in _flags(name, word)):
                return False
        elif not any(_glob(a, word) for a in positional):
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
    name = next((n for n in rule_names(program(argv[0])) if _glob(n, words[0])), None)
    if name is None:  # a program run by another (ld.so /bin/rm, python3 -m pip): the word naming it
        for arg in args:
            names = rule_names(program(arg).split(".", 1)[0])
            name = next((n for n in names if _glob(n, words[0])), None)
            if name is not None:
                found.append(arg)
                break
    name = name or program(argv[0])
    try:
        operands, options = args[args.index("--") + 1 :], args[: args.index("--")]
    except ValueError:
        operands, options = [], args
    positional = [a for a in options if not a.startswith("-")] + operands
    for word in words[1:]:
        if word.startswith("-"):
            hits = [_carrier(name, flag, args) for flag in _flags(name, word)]
        else:
            slots = _npm_slots(args) if name == "npm" else []
            named = (args[at] for at in slots if _npm_names(name, args, at, word))
            hits = [next((a for a in positional if _glob(a, word)), next(named, None))]
        found += [hit for hit in hits if hit is not None and hit not in found]
    return found


def judge(rules: "Dict[str, List[List[str]]]", argv: "Sequence[str]") -> "Tuple[str, Optional[str]]":
    """The verdict on one exec: ``("deny", rule)``, ``("approve", rule)`` or ``("allow", None)``.

    ``rules`` maps ``deny``/``approve``/``allow`` to patterns as word lists; a non-empty
    ``allow`` lets only what it names run. Deny beats the allowlist beats approve.
    """
    command = subject(argv)
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

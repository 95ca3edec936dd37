"""npm's command line as npm reads it: its commands and their other spellings (aliases,
prefixes, camelCase), which of them install as ``npm install`` does, its options that take
no value, and where its command is.

What the exec rules (``execrules``) know of npm alone, apart from how a rule is matched:
npm's tables change with npm, the matcher does not. Standard library only (it runs inside
the sandbox), and imports none of the supervisor's modules.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Sequence  # noqa: F401 - Dict: in a type comment

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


def npm_slots(args: "Sequence[str]") -> "List[int]":
    """Where in npm's ``args`` its command may be: the first word that is no option, and each
    one after an option (its value, or the command after an option that takes none): npm's
    options are many and change, so each reading is judged, which errs on the side of asking
    (as ``execruns.scripts`` reads an interpreter's command line)."""
    slots: "List[int]" = []
    after_option = False
    for at, word in enumerate(args):
        if word == "--":
            return slots + ([at + 1] if at + 1 < len(args) else [])
        if len(word) > 1 and word[0] == "-":
            after_option = not npm_flag(word)
            continue
        slots.append(at)
        if not after_option:
            break
        after_option = False
    return slots


def npm_flag(word: str) -> bool:
    """Whether npm's option ``word`` takes no value from the next word."""
    if word.startswith("--"):
        return "=" in word or word.startswith("--no-") or word[2:] in NPM_FLAGS
    return all(letter in NPM_SHORT_FLAGS for letter in word[1:])


def npm_implied(args: "Sequence[str]") -> "List[str]":
    """The commands besides its own that an npm command line runs (``npm_installs``): a
    rule's word matches these too (``npm ci`` installs: a rule over ``npm install`` holds)."""
    return ["install" for at in npm_slots(args) if npm_installs(args, at)]


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


def npm_names(name: str, args: "Sequence[str]", at: int, word: str) -> bool:
    """Whether npm's ``args[at]`` is another spelling of the rule's ``word`` (``add``:
    ``install``), or a command that installs as it does (``npm_installs``)."""
    if name != "npm":
        return False
    command = npm_command(args[at])
    return command is not None and (command == word or (word == "install" and npm_installs(args, at)))


def npm_command_at(args: "Sequence[str]") -> "Optional[int]":
    """Where npm's command is in ``args``, past its options that take no value (``NPM_FLAGS``)
    and a ``--`` (``len(args)``: there is none); None where that is unsure: an option that
    may take a value (``npm --prefix x test``: either word may be the command)."""
    for at, word in enumerate(args):
        if word == "--":
            return at + 1
        if not (len(word) > 1 and word[0] == "-"):
            return at
        if not npm_flag(word):
            return None
    return len(args)

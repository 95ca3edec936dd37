"""git's command line as git reads it: its own commands, its plumbing that does what a
porcelain command does, its options before the command, and where that command is.

What the exec rules (``execrules``) know of git alone, apart from how a rule is matched:
the table of git's commands changes with git, the matcher does not. Standard library only
(it runs inside the sandbox), and imports none of the supervisor's modules.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Optional, Sequence

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
# version, so the command may be either of the two words after it (git_alias).
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


def git_alias(args: "Sequence[str]") -> bool:
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


def git_command_at(args: "Sequence[str]") -> "Optional[int]":
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

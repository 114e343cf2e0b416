"""Files only their owner may read: weights written to disk are the model, and a host's other users
must not read them (before, file-transport files were 0644 in a 0755 folder).

:func:`private_directory` creates a folder 0700 (one that exists is left as it is: it may be the
user's own, shared on purpose); :func:`private_opener`, given to ``open(..., opener=)``, creates a file
0600. Both ignore a looser umask: the mode is asked for at creation, never widened afterwards.

Nor may other users *write* them: a folder another user made, or one others can write, lets them plant
the files a reader loads, or delete the writer's. :func:`owned_directory` refuses such a folder (and one
inside a folder others could swap it out of); :func:`check_own_file` refuses a file that is a link, not
this user's, or writable by others; :func:`private_opener` creates with ``O_EXCL | O_NOFOLLOW``, so a
file or link planted at the name is refused, never followed or reused.
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger("weightsync.transport.private")

__all__ = ["private_directory", "private_opener", "check_private_directory", "owned_directory", "check_own_file"]


def private_directory(path: str | os.PathLike) -> None:
    """``os.makedirs(path, exist_ok=True)``, the folders it creates 0700."""
    path = os.fspath(path)
    missing, head = [], os.path.abspath(path)
    while not os.path.exists(head) and os.path.dirname(head) != head:
        missing.append(head)
        head = os.path.dirname(head)
    os.makedirs(path, mode=0o700, exist_ok=True)
    for made in missing:  # makedirs gives the mode to the leaf only, and the umask may narrow it further
        try:
            os.chmod(made, 0o700)
        except OSError:  # made by someone else meanwhile: theirs to set
            pass
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077 and not missing:
        log.info("%s already exists with mode %o: the files weightsync writes there are 0600, but other users "
                 "may list their names", path, mode)


def private_opener(path: str, flags: int) -> int:
    """For ``open(path, "wb"/"w", opener=private_opener)``: a new file created 0600 (its owner reads and writes it);
    a file or link already at ``path`` raises ``FileExistsError`` (``O_EXCL``): nothing planted is written through."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _loose(st: os.stat_result, euid: int) -> str | None:
    """Why a folder or file of mode/owner ``st`` could be written by a user other than ``euid`` (None: it cannot)."""
    if st.st_uid != euid:
        return f"owned by uid {st.st_uid}, not this process's uid {euid}"
    loose = st.st_mode & 0o022
    if loose:
        who = "group and others" if loose == 0o022 else "group" if loose == 0o020 else "others"
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def owned_directory(path: str | os.PathLike, what: str = "directory") -> str:
    """:func:`private_directory`, then its real path, refused (``ConfigError``) unless no other user can write it:
    the folder is this user's and not group/other-writable (a sticky bit is no excuse: it only keeps others from
    deleting, not from planting), and every folder above it is this user's or root's and not writable by others
    unless sticky (``/tmp``), so no one can swap it out. The real path is what the caller uses from then on: a
    link on the way that is re-pointed later cannot redirect the files."""
    from weightsync.errors import ConfigError

    given = os.fspath(path)
    private_directory(given)
    real = os.path.realpath(given)
    euid = os.geteuid()
    st = os.stat(real)
    why = _loose(st, euid) if stat.S_ISDIR(st.st_mode) else "not a directory"
    if why is not None:
        raise ConfigError(
            f"the {what} {given} is {why}: another user of this host could plant the files a reader loads there, "
            f"or delete this job's. Use a directory only this user can write: a path that does not exist yet "
            f"(weightsync creates it 0700), or, if the folder is this user's own, `chmod go-w {real}`")
    parent = os.path.dirname(real)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, euid):
            raise ConfigError(f"the {what} {given} lies in {parent}, owned by uid {st.st_uid}: that user could "
                              "replace the directory with one of their own. Use a directory under a folder of this "
                              "user's or root's")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(f"the {what} {given} lies in {parent}, writable by others without the sticky bit "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}): another user could replace the directory "
                              "with one of their own. Use a directory under a folder only this user can write")
        up = os.path.dirname(parent)
        if up == parent:
            return real
        parent = up


def check_own_file(path: str) -> str | None:
    """Why the file at ``path`` must not be read as this user's own (None: a regular file, not a link, of this
    user, that no one else can write). Its name was looked up, never followed."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (to {os.readlink(path)!r})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    why = _loose(st, os.geteuid())
    return None if why is None else f"is {why}"


def check_private_directory(d: str, prefixes: tuple[str, ...], error: type[Exception], what: str) -> None:
    """Raise ``error`` unless ``d`` is an absolute path named with one of ``prefixes``, a directory (not a link)
    of this user, 0700 or tighter: where a weightsync key or call channel may be trusted."""
    if not isinstance(d, str) or not os.path.isabs(d) or not os.path.basename(d).startswith(prefixes):
        raise error(f"{what} {d!r} is not a {' or '.join(p.rstrip('-') for p in prefixes)} directory")
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise error(f"{what} {d!r} is not a private directory of uid {os.geteuid()} (mode "
                    f"{oct(st.st_mode & 0o777)}, owner {st.st_uid})")

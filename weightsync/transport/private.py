"""Files only their owner may read: weights written to disk are the model, and a host's other users
must not read them (before, file-transport files were 0644 in a 0755 folder).

:func:`private_directory` creates a folder 0700 (one that exists is left as it is: it may be the
user's own, shared on purpose); :func:`private_opener`, given to ``open(..., opener=)``, creates a file
0600. Both ignore a looser umask: the mode is asked for at creation, never widened afterwards.
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger("weightsync.transport.private")

__all__ = ["private_directory", "private_opener", "check_private_directory"]


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
    """For ``open(path, mode, opener=private_opener)``: a file created 0600 (its owner reads and writes it)."""
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


def check_private_directory(d: str, prefixes: tuple[str, ...], error: type[Exception], what: str) -> None:
    """Raise ``error`` unless ``d`` is an absolute path named with one of ``prefixes``, a directory (not a link)
    of this user, 0700 or tighter: where a weightsync key or call channel may be trusted."""
    if not isinstance(d, str) or not os.path.isabs(d) or not os.path.basename(d).startswith(prefixes):
        raise error(f"{what} {d!r} is not a {' or '.join(p.rstrip('-') for p in prefixes)} directory")
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise error(f"{what} {d!r} is not a private directory of uid {os.geteuid()} (mode "
                    f"{oct(st.st_mode & 0o777)}, owner {st.st_uid})")

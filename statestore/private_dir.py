"""Directories of one user's own on a shared host (``private_directory``).

The temporary directory is shared by every user of the host. What the store keeps there
(the file cache's segment copies, the timer beacons of a query) must be in a directory that
no other user made, could replace or could write to: otherwise another user could plant
files that are read as ours, or links that make us write a file of our user's elsewhere
(``docs/reliability.md``, threat model). Light: the ticks source's processes import it.
"""

from __future__ import annotations

import contextlib
import os
import stat


def private_directory(directory: str, *, what: str, others_may_read: bool = False) -> str:
    """``directory``, made (mode 0700) if missing, checked to be a real directory (not a link)
    owned by this user that no one else may write to (nor read, unless ``others_may_read``).

    Raises:
        PermissionError: it is not; the message names it, ``what`` it is for and what to do.
    """
    with contextlib.suppress(FileExistsError):
        os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)
        os.mkdir(directory, 0o700)
    st = os.lstat(directory)
    forbidden = 0o022 if others_may_read else 0o077
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & forbidden:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise PermissionError(
            f"the directory of {what}, {directory}, is not this user's alone ({kind}, owned by uid {st.st_uid}, "
            f"mode {stat.S_IMODE(st.st_mode):o}; this process runs as uid {os.getuid()}): another user of the host "
            "could plant files in it or make this process overwrite files. Remove it (it is made again, "
            "private), or point TMPDIR at a directory of your own")
    return directory

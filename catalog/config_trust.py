"""Which pyiceberg configuration file may name code (``check_pyiceberg_config``).

pyiceberg reads its catalogs from the first ``.pyiceberg.yaml`` it finds in ``$PYICEBERG_HOME``,
the home directory, then the *current directory*, and a catalog's configuration there may
name classes for it to import and call (``py-catalog-impl``, ``py-io-impl``). A command run
in a directory someone else can write to (a shared checkout, ``/tmp``) would take theirs. So,
as git does with repositories of other owners, a configuration file is used only when it is
this user's (or root's) and no one else may write to it (``docs/reliability.md``, threat model).
"""

from __future__ import annotations

import os
import stat

from statestore.errors import CatalogUnavailableError

CONFIG_FILE = ".pyiceberg.yaml"


def pyiceberg_config_file() -> str | None:
    """The configuration file pyiceberg reads (its own search order), or None."""
    for directory in (os.environ.get("PYICEBERG_HOME"), os.path.expanduser("~"), os.getcwd()):
        if directory and os.path.isfile(os.path.join(directory, CONFIG_FILE)):
            return os.path.join(directory, CONFIG_FILE)
    return None


def check_pyiceberg_config() -> None:
    """Raise ``CatalogUnavailableError`` when pyiceberg's configuration file is another user's
    or others may write to it (module docstring)."""
    path = pyiceberg_config_file()
    if path is None:
        return
    st = os.stat(path)
    if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
        raise CatalogUnavailableError(
            f"pyiceberg's configuration file {path} is not this user's own (owned by uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}; this process runs as uid {os.getuid()}): it can name code for pyiceberg "
            "to import (py-catalog-impl, py-io-impl), so it is not used. Make it yours and writable by you "
            "alone, or set PYICEBERG_HOME to a directory holding your own")

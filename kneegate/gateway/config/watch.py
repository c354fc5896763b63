"""Reload the config when its file changes on disk, as SIGHUP would.

Kubernetes updates a ConfigMap volume by swapping a symlink, never by writing the file:

    kneegate.yaml -> ..data/kneegate.yaml
    ..data        -> ..2026_12_01_10_00_00.123456789     (replaced atomically by a rename)

so the file's identity is taken through every link: the resolved path, device, inode, size
and modification time (`identify`). The gateway polls it every `server.config_poll_interval`
seconds (one `realpath` and one `stat`: microseconds, on the tick's event loop, never on a
request's path). A change is reloaded once it has held for one interval, so an editor's
half-written file is not read; each identity is tried once, so a bad file is refused (and
counted) once, not at every poll, and the running config stays until the file changes again.
"""

from __future__ import annotations

import os

__all__ = ["ConfigWatcher", "FileIdentity", "identify"]

# (resolved path, device, inode, size, mtime in ns); None when the file cannot be stat'ed
FileIdentity = tuple[str, int, int, int, int] | None


def identify(path: str) -> FileIdentity:
    """What tells one version of the file at `path` from another, links followed."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ConfigWatcher:
    """Says, poll by poll, when the file at `path` is due for a reload.

    `loading()` is called by every reload (a signal, the endpoint or this watcher) just
    before the file is read: the identity it records is the one that reload judged.
    """

    __slots__ = ("_seen", "loaded", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.loaded = identify(path)
        self._seen = self.loaded

    def loading(self) -> None:
        self.loaded = self._seen = identify(self.path)

    def poll(self) -> bool:
        """True when the file differs from the one last loaded and held still since the
        previous poll."""
        now = identify(self.path)
        due = now != self.loaded and now == self._seen
        self._seen = now
        return due

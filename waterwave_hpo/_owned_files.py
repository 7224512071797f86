"""Folders the project writes into (``--out``): never move, rewrite or delete a file not its own.

A folder the project writes into holds a manifest, :data:`MANIFEST_NAME`, written before any
other file. It names the tool and the kind of folder (``demo``, ``bench``) and, per file the
project wrote, its SHA-256. A file of a name the project uses is replaced only when it is
recorded there with the bytes it still has; any other file of such a name (a user's
``README.md``, a ``trials.csv`` edited by hand) is refused before anything is written, naming
the path and the fix. Files that are appended to by several processes (the demo's journal) are
recorded as such and checked by their own format instead of a hash.

A folder an earlier version wrote (no manifest) is adopted only when a check of the caller
recognises its files (``recognise``: their format, or for a file derived from data beside it,
its exact bytes, so that a file the user edited since is never rewritten); anything else is
refused.

Writes go to a temporary file (exclusively created, never an existing name) in the folder and
are renamed over the target after the target was checked again, under a lock on the folder, so
two processes sharing one folder cannot record each other's files as foreign.

This module is private to the package: other packages of ``waterwave_hpo`` may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
import contextlib
import hashlib
import json
import os
from pathlib import Path
import tempfile
from typing import Any

from waterwave_hpo import _checks
from waterwave_hpo._version import __version__

MANIFEST_NAME = "waterwave-run.json"
"""The manifest the project writes first in every folder it writes into."""

_WRITTEN_BY = "waterwave-hpo"


class OutFolderError(ValueError):
    """A folder to write into is refused (empty, a file, or holding a file not the project's).

    Attributes:
        detail: The message without its ``name=value:`` head (``"<problem>; <fix>."``), for a
            caller that names the argument its own way (a command line flag).
    """

    def __init__(self, argument: str, value: object, problem: str, fix: str) -> None:
        self.detail = f"{problem}; {fix}."
        super().__init__(_checks.message(argument, value, problem, fix))


class ForeignFileError(OutFolderError):
    """A file the project would write exists and was not written by it; nothing was changed.

    Attributes:
        path: The file that is not the project's.
    """

    def __init__(self, argument: str, value: object, path: Path, problem: str, fix: str) -> None:
        self.path = path
        super().__init__(argument, value, f"{path} {problem}", fix)


def check_out_value(argument: str, value: object) -> Path:
    """``value`` as a :class:`~pathlib.Path` if it names a folder (not ``''``, not a file).

    Args:
        argument: The argument's name (``out``).
        value: A path (``str`` or ``os.PathLike``).

    Returns:
        The path, user-expanded and absolute.

    Raises:
        TypeError: ``value`` is not a path.
        OutFolderError: ``value`` is empty, or an existing file that is not a folder.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise _checks.type_error(argument, value, "a path", "pass a directory, e.g. 'runs/demo'")
    text = os.fspath(value)
    if isinstance(text, bytes) or not text.strip():
        raise OutFolderError(
            argument,
            value,
            "is empty (it would write into the current directory)",
            "pass a directory, e.g. 'runs/demo' (created if missing)",
        )
    path = Path(text).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise OutFolderError(
            argument,
            value,
            "is a file, not a directory",
            "pass a directory (created if missing)",
        )
    return path


def sha256_of(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class OwnedFolder:
    """A folder the project writes into, claimed by :func:`claim_folder`.

    Attributes:
        path: The folder (absolute).
        kind: What wrote it (``demo``, ``bench``).
        argument: The argument that named it (``out``), for messages.
        value: The value given for it, for messages.
    """

    def __init__(self, path: Path, kind: str, argument: str, value: object) -> None:
        self.path = path
        self.kind = kind
        self.argument = argument
        self.value = value

    @property
    def manifest(self) -> Path:
        """The folder's manifest file."""
        return self.path / MANIFEST_NAME

    def write(self, name: str, produce: Callable[[Path], object]) -> Path:
        """Write the file ``name``: ``produce(temporary_path)``, then rename it over ``name``.

        Args:
            name: The file's name in the folder.
            produce: Writes the file's content to the path it is given (which has ``name``'s
                suffix, for writers that choose a format by it, such as ``savefig``).

        Returns:
            The file written.

        Raises:
            ForeignFileError: ``name`` exists and is not recorded with its bytes as the
                project's (the temporary file is removed; ``name`` is left as it was).
        """
        target = self.path / name
        with _folder_lock(self.path):
            files = self._read_manifest()["files"]
            self._check_name(name, files, legacy=None)
            fd, temporary = tempfile.mkstemp(
                dir=self.path, prefix=f".{name}.", suffix=Path(name).suffix
            )
            os.close(fd)
            staged = Path(temporary)
            try:
                produce(staged)
                digest = sha256_of(staged)
                self._check_name(name, self._read_manifest()["files"], legacy=None)
                os.replace(staged, target)
            finally:
                staged.unlink(missing_ok=True)
            self._record({name: {"sha256": digest}})
        return target

    def write_text(self, name: str, text: str) -> Path:
        """Write ``text`` to the file ``name`` (see :meth:`write`)."""
        return self.write(name, lambda path: path.write_text(text))

    def _read_manifest(self) -> dict[str, Any]:
        data = _read_manifest(self.manifest)
        if data is None or data.get("kind") != self.kind:
            raise ForeignFileError(
                self.argument,
                self.value,
                self.manifest,
                "is no longer the manifest waterwave-hpo wrote; nothing was changed",
                "pass a new directory",
            )
        return data

    def _record(self, entries: Mapping[str, Mapping[str, Any]]) -> None:
        data = self._read_manifest()
        data["files"].update(entries)
        _replace_json(self.manifest, data)

    def _check_name(
        self,
        name: str,
        files: Mapping[str, Any],
        legacy: Callable[[Path], bool] | None,
    ) -> dict[str, Any] | None:
        """Refuse ``name`` if it exists and is not the project's; the entry to record, if any."""
        path = self.path / name
        if not os.path.lexists(path):
            return None
        entry = files.get(name)
        if isinstance(entry, dict) and entry.get("appended"):
            return None  # kept by its own protocol (a journal, its lock), checked by its reader
        if path.is_symlink() or not path.is_file():
            problem = "is not a regular file waterwave-hpo wrote; nothing was changed"
        elif isinstance(entry, dict) and "sha256" in entry:
            if sha256_of(path) == entry["sha256"]:
                return None
            problem = (
                "was changed since waterwave-hpo wrote it (its SHA-256 differs from the one in "
                f"{MANIFEST_NAME}); nothing was changed"
            )
        elif legacy is not None and legacy(path):
            return {"sha256": sha256_of(path), "adopted": True}
        elif legacy is not None:
            problem = (
                f"was not written by waterwave-hpo: it is not recorded in {MANIFEST_NAME}, and "
                "it is not a file an earlier version of waterwave-hpo wrote, as it wrote it "
                "(edited since?); nothing was changed"
            )
        else:
            problem = (
                f"was not written by waterwave-hpo (it is not recorded in {MANIFEST_NAME}); "
                "nothing was changed"
            )
        raise ForeignFileError(
            self.argument,
            self.value,
            path,
            problem,
            f"pass a new or empty directory, or move {path} out of the way",
        )


def claim_folder(
    value: object,
    *,
    kind: str,
    names: Sequence[str],
    appended: Sequence[str] = (),
    recognise: Mapping[str, Callable[[Path], bool]] | None = None,
    argument: str = "out",
    fresh: bool = False,
) -> OwnedFolder:
    """Claim the folder ``value`` for writing the files ``names``; refuse it before any write.

    The folder is created if missing and its manifest written first. In a folder that has a
    manifest of ``kind``, each existing file of ``names`` must be recorded in it with its bytes
    (or as appended). In a folder without a manifest, an existing file of ``names`` is
    adopted only if ``recognise[name]`` accepts it and every ``recognise`` check of the files
    present passes; otherwise it is refused.

    Args:
        value: The folder, as the user gave it.
        kind: What writes it, e.g. ``"demo"``; a manifest of another kind is refused.
        names: Every file name the caller will write or append to.
        appended: The names among ``names`` that are appended to in place (a journal): recorded
            without a hash.
        recognise: Format checks of the project's own files, by name, for folders an earlier
            version wrote without a manifest. ``None``: no adoption.
        argument: The argument's name, for messages.
        fresh: The folder must not exist yet (it is created exclusively).

    Returns:
        The claimed folder.

    Raises:
        TypeError: ``value`` is not a path.
        OutFolderError: ``value`` is empty or a file.
        ForeignFileError: A file of ``names`` (or the manifest) exists and is not the project's.
        FileExistsError: ``fresh`` and the folder exists.
        OSError: The folder cannot be created or written.
    """
    path = check_out_value(argument, value)
    path.mkdir(parents=True, exist_ok=not fresh)
    folder = OwnedFolder(path, kind, argument, value)
    with _folder_lock(path):
        existing = os.path.lexists(folder.manifest)
        if existing:
            data = _read_manifest(folder.manifest)
            if data is None:
                raise ForeignFileError(
                    argument,
                    value,
                    folder.manifest,
                    "was not written by waterwave-hpo; nothing was changed",
                    f"pass a new or empty directory, or move {folder.manifest} out of the way",
                )
            if data.get("kind") != kind:
                raise ForeignFileError(
                    argument,
                    value,
                    folder.manifest,
                    f"says this is a {data.get('kind')} folder, not a {kind} folder; nothing was "
                    "changed",
                    f"pass a new directory for the {kind}",
                )
            files = data["files"]
            for name in names:
                folder._check_name(name, files, legacy=None)
            return folder
        checks = recognise or {}
        adopted: dict[str, dict[str, Any]] = {}
        for name in names:
            check = checks.get(name)
            entry = folder._check_name(name, {}, legacy=check)
            if entry is not None:
                adopted[name] = {"appended": True} if name in appended else entry
        manifest = {
            "written_by": _WRITTEN_BY,
            "version": __version__,
            "kind": kind,
            "files": {name: {"appended": True} for name in appended} | adopted,
        }
        _create_json(folder.manifest, manifest)
    return folder


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest's data if it is one of the project's, else ``None``."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(data, dict)
        or data.get("written_by") != _WRITTEN_BY
        or not isinstance(data.get("files"), dict)
    ):
        return None
    return data


def _staged_json(folder: Path, data: Mapping[str, Any]) -> Path:
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST_NAME}.", suffix=".tmp")
    with os.fdopen(fd, "w") as file:
        file.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
        file.flush()
        os.fsync(file.fileno())
    return Path(temporary)


def _create_json(path: Path, data: Mapping[str, Any]) -> None:
    """Create ``path`` whole (never over an existing file: ``os.link`` fails on one)."""
    staged = _staged_json(path.parent, data)
    try:
        os.link(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def _replace_json(path: Path, data: Mapping[str, Any]) -> None:
    staged = _staged_json(path.parent, data)
    try:
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


@contextlib.contextmanager
def _folder_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the folder itself (no lock file is added to it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: processes sharing a folder are not serialized here
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

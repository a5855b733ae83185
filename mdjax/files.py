"""Files that came from elsewhere, read and written safely (docs/security.md).

Reading: regular files only (a FIFO, socket, device or folder is refused without waiting on
it), symbolic links refused where asked. Writing: through no link or FIFO planted at the name,
and replacing a file only once its new content is complete (a fresh temporary name beside it,
then a rename). Refusals are `UnsafeFile`, a ValueError naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from typing import BinaryIO

NOT_REGULAR = "not a regular file (a FIFO, socket, device or folder)"
NEW_FILE_MODE = 0o644


class UnsafeFile(ValueError):
  """A file that is a symbolic link where none is followed, or not a regular file."""

  def __init__(self, path: str, problem: str):
    super().__init__(f"{path}: {problem}")
    self.path, self.problem = path, problem


def link_problem(path: str) -> str:
  """What a symbolic link at `path` is, for a message."""
  try:
    return f"a symbolic link (to {os.readlink(path)!r})"
  except OSError:  # ELOOP from a loop further up the path
    return "a symbolic link"


def open_fd(path: str, flags: int = os.O_RDONLY, *, follow_links: bool = True,
            mode: int = NEW_FILE_MODE) -> int:
  """os.open of a regular file, never blocking on a FIFO (opened non-blocking, checked, then
  set back to blocking); follow_links=False refuses a link at `path` itself. UnsafeFile for a
  link or another kind of file, FileNotFoundError when nothing is there (and no O_CREAT)."""
  flags |= os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
  try:
    fd = os.open(path, flags, mode)
  except FileNotFoundError:
    raise
  except OSError as error:
    if error.errno == errno.ELOOP and not follow_links:
      raise UnsafeFile(path, link_problem(path)) from None
    if error.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO opened to write, no reader
      raise UnsafeFile(path, NOT_REGULAR) from None
    raise ValueError(f"{path}: cannot open ({error.strerror})") from None
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise UnsafeFile(path, NOT_REGULAR)
  os.set_blocking(fd, True)
  return fd


def open_regular(path: str, *, follow_links: bool = True) -> BinaryIO:
  """A regular file opened to read in binary (`open_fd`); a ValueError naming it when it is
  missing too."""
  try:
    return os.fdopen(open_fd(path, follow_links=follow_links), "rb")
  except FileNotFoundError:
    raise ValueError(f"{path}: no such file") from None


def read_text(path: str) -> str:
  """A regular file's UTF-8 text; a ValueError naming the file when it is not UTF-8."""
  with open_regular(path) as f:
    data = f.read()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text ({e})") from e


def create_file(path: str, *, exclusive: bool = False) -> BinaryIO:
  """`open(path, "wb")` through no link, FIFO or device planted at `path`; `exclusive`: a
  new file only."""
  fd = open_fd(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else 0),
               follow_links=False)
  os.ftruncate(fd, 0)
  return os.fdopen(fd, "wb")


def regular_file(path: str) -> bool:
  """Whether `path` names a regular file (through links): False when nothing is there, an
  UnsafeFile when something else is."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    return False
  except OSError as error:
    raise ValueError(f"{path}: cannot read ({error.strerror})") from None
  if not stat.S_ISREG(mode):
    raise UnsafeFile(path, NOT_REGULAR)
  return True


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb", *, sync: bool = False):
  """A new file that replaces `path` once the block ends without error: written under a fresh
  temporary name in the same folder and renamed over `path`, so a reader never sees half a
  file and a link at `path` is replaced, not written through. The file's permissions are kept
  (NEW_FILE_MODE for a new one)."""
  try:
    permissions = stat.S_IMODE(os.lstat(path).st_mode) if regular_file(path) else NEW_FILE_MODE
  except UnsafeFile:
    permissions = NEW_FILE_MODE
  folder, name = os.path.split(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
  try:
    os.fchmod(fd, permissions)  # mkstemp makes it 0o600
    with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
      yield f
      if sync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


class DuplicateKey(ValueError):
  """A JSON object lists this key twice."""


def unique_keys_hook(pairs: list) -> dict:
  """A JSON object's dict; a key listed twice is an error (json keeps the last silently)."""
  out = dict(pairs)
  if len(out) < len(pairs):
    seen = set()
    for key, _ in pairs:
      if key in seen:
        raise DuplicateKey(key)
      seen.add(key)
  return out


def read_json(path: str, what: str = "JSON file", *, unique_keys: bool = False) -> dict:
  """A JSON file's top-level object; a ValueError naming the file when it is not a regular
  file, not UTF-8 JSON, nested too deep, not an object or (unique_keys) lists a key twice."""
  with open_regular(path) as f:
    data = f.read()
  try:
    raw = json.loads(data.decode("utf-8"), object_pairs_hook=unique_keys_hook if unique_keys else None)
  except DuplicateKey as error:
    raise ValueError(f"{path}: key {error.args[0]!r} appears twice in one object") from None
  except RecursionError:
    raise ValueError(f"{path}: unreadable {what} (nested too deeply)") from None
  except ValueError as error:  # bad UTF-8, bad JSON, a number past the int digit limit
    raise ValueError(f"{path}: unreadable {what} ({error})") from None
  if not isinstance(raw, dict):
    raise ValueError(f"{path}: not a JSON object (a JSON {type(raw).__name__})")
  return raw

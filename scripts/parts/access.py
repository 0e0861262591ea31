"""Whether another user may run a file: every folder on its way entered, the file itself
read and run, by the owner's, the group's or the others' bits, whichever apply to that
user (as the kernel chooses them; ACLs are not read)."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

READ, RUN = 0o4, 0o1  # a folder is entered with RUN


@dataclass(frozen=True)
class User:
    name: str
    uid: int | None  # None: not made yet; a system user of its own gets the others' bits
    gids: frozenset[int]

    @classmethod
    def named(cls, name: str) -> User:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            return cls(name, None, frozenset())
        return cls(name, entry.pw_uid, frozenset(os.getgrouplist(name, entry.pw_gid)))

    def may(self, found: os.stat_result, bits: int) -> bool:
        if self.uid == 0:  # root runs a file only where someone may
            return not bits & RUN or stat.S_ISDIR(found.st_mode) or bool(found.st_mode & 0o111)
        if found.st_uid == self.uid:
            shift = 6
        elif found.st_gid in self.gids:
            shift = 3
        else:
            shift = 0
        return (found.st_mode >> shift) & bits == bits


def cannot_use(user: User, needs: dict[Path, int]) -> str | None:
    """Why `user` could not use each path as `needs` says (READ, RUN or both), or None:
    the first folder on a path's way (as named and where its links lead) it may not
    enter, or the path it may not read or run."""
    for path, bits in needs.items():
        for way in dict.fromkeys([path.absolute(), path.resolve()]):
            for folder in reversed(way.parents):
                if not user.may(folder.stat(), RUN):
                    return (
                        f"{user.name} cannot enter {folder} ({shown(folder)}), on the way to {way}"
                    )
            if not user.may(way.stat(), bits):
                verb = {READ: "read", RUN: "run"}.get(
                    bits, "read" if way.is_dir() else "read and run"
                )
                return f"{user.name} cannot {verb} {way} ({shown(way)})"
    return None


def shown(path: Path) -> str:
    """'drwx------ al:al', as ls shows a path's mode and owners."""
    found = path.stat()
    return f"{stat.filemode(found.st_mode)} {_name(found.st_uid)}:{_group(found.st_gid)}"


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)

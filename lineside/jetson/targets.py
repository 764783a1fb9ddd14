"""Where `lineside jetson push` installs a bundle: a local/mounted directory, or `user@host:/dir` over ssh.

Both targets offer the same few operations; the ssh one runs small POSIX shell commands on the
device (mkdir, sha256sum --check, mv -T, ln -s) and copies with rsync, so the device needs only
sshd, rsync and coreutils.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from lineside.bundle import sha256_file
from lineside.errors import LinesideError

_CHUNK = 1 << 20
SSH_CONNECT_TIMEOUT_S = 10  # seconds to reach the host and read its SSH banner (the LAN's devices answer in well under 1)
Progress = Callable[[int], None]


class DiskFull(LinesideError):
    """The target's disk filled during the copy (df showed room: another writer took it meanwhile)."""


class LocalTarget:
    """A directory on this machine (or a mounted device filesystem)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.label = str(self.root)

    def close(self) -> None:
        pass

    def prepare(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise LinesideError(f"{self.root} is not a directory; pass a directory (or user@host:/dir) as TARGET")
        (self.root / "versions").mkdir(parents=True, exist_ok=True)

    def space(self, staging: str) -> tuple[int, int]:
        """(bytes free where versions/ lives, bytes already in versions/<staging> from an interrupted push)."""
        base = self.root / "versions" / staging
        have = sum(f.stat().st_size for f in base.rglob("*") if f.is_file()) if base.is_dir() else 0
        return shutil.disk_usage(self.root / "versions").free, have

    def installed_versions(self) -> dict[str, str]:
        """{version dir name: sha256 of its manifest.json}."""
        out = {}
        vdir = self.root / "versions"
        for d in sorted(vdir.iterdir()) if vdir.is_dir() else []:
            if not d.name.startswith(".") and (d / "manifest.json").is_file():
                out[d.name] = sha256_file(d / "manifest.json")
        return out

    def upload(self, src: Path, staging: str, files: list[str], progress: Progress | None) -> dict[str, int]:
        """Copy files into versions/<staging>, appending to partial files (like rsync --append)."""
        dst_root = self.root / "versions" / staging
        sent = resumed = 0
        for rel in files:
            s, d = src / rel, dst_root / rel
            d.parent.mkdir(parents=True, exist_ok=True)
            size = s.stat().st_size
            have = d.stat().st_size if d.is_file() else 0
            if have == size:
                continue
            if have > size:
                have = 0
            resumed += have > 0
            try:
                with open(s, "rb") as fi, open(d, "ab" if have else "wb") as fo:
                    fi.seek(have)
                    while chunk := fi.read(_CHUNK):
                        fo.write(chunk)
                        sent += len(chunk)
                        if progress:
                            progress(len(chunk))
                    fo.flush()
                    os.fsync(fo.fileno())
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise DiskFull(str(d)) from None
                raise
        return {"bytes_sent": sent, "resumed_files": resumed}

    def remove_staging(self, staging: str) -> None:
        shutil.rmtree(self.root / "versions" / staging, ignore_errors=True)

    def verify(self, staging: str, expected: dict[str, str]) -> list[str]:
        """Files in versions/<staging> whose sha256 differs from ``expected`` (or that are missing)."""
        base = self.root / "versions" / staging
        return [rel for rel, sha in expected.items() if not (base / rel).is_file() or sha256_file(base / rel) != sha]

    def discard(self, staging: str, files: list[str]) -> None:
        for rel in files:
            (self.root / "versions" / staging / rel).unlink(missing_ok=True)

    def finalize(self, staging: str, version: str) -> None:
        os.rename(self.root / "versions" / staging, self.root / "versions" / version)

    def links(self) -> tuple[str | None, str | None]:
        """(current, previous) link targets relative to the root, None where absent."""
        return tuple(os.readlink(self.root / n) if (self.root / n).is_symlink() else None
                     for n in ("current", "previous"))  # type: ignore[return-value]

    def exists(self, rel: str) -> bool:
        return (self.root / rel / "manifest.json").is_file()

    def switch(self, current: str, previous: str | None) -> None:
        """Point previous, then current, at version dirs; each by symlink + os.replace (atomic)."""
        for name, target in (("previous", previous), ("current", current)):
            if target is None:
                continue
            link = self.root / name
            if link.exists() and not link.is_symlink():
                raise LinesideError(f"{link} exists and is not a symlink; move it away, then push again")
            tmp = self.root / f".{name}.tmp-{os.getpid()}"
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            os.symlink(target, tmp)
            os.replace(tmp, link)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class SshTarget:
    """`user@host:/dir`: rsync over ssh, verification and activation by remote shell commands."""

    def __init__(self, host: str, root: str, ssh: str = "ssh", port: int | None = None) -> None:
        self.host = host  # [user@]name or [user@]IPv6 address, as ssh takes it
        self.rsync_host = _bracketed(host)  # rsync (like scp) needs [v6]:/dir
        self.root = root[2:] if root.startswith("~/") else root
        # One multiplexed connection for the ~10 commands of a push (each new one costs a handshake).
        control = os.path.join(tempfile.gettempdir(), "lineside-ssh-%C")
        # ConnectTimeout: ssh has none of its own, so a host that takes the connection and never speaks SSH held
        # `fleet status` (and a push) for the whole command timeout. An --ssh command's own -o comes first and wins.
        self.login = shlex.join([*shlex.split(ssh), *(["-p", str(port)] if port else []), host])  # for hints
        self.ssh = shlex.split(ssh) + (["-p", str(port)] if port else []) + ["-o", "BatchMode=yes", "-o", "ControlMaster=auto",
                                       "-o", f"ControlPath={control}", "-o", "ControlPersist=30",
                                       "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]
        # what the user can paste back (rollback, the next push): a port only fits the ssh:// form
        self.label = f"ssh://{_bracketed(host)}:{port}{urllib.parse.quote(root)}" if port else f"{_bracketed(host)}:{root}"
        self._q = shlex.quote(self.root)
        self._installed: dict[str, str] = {}

    def _run(self, script: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            p = subprocess.run([*self.ssh, self.host, script], input=stdin, capture_output=True, text=True,
                               timeout=600)
        except FileNotFoundError:
            raise LinesideError(f"{self.ssh[0]} not found; install an ssh client (openssh-client)") from None
        except subprocess.TimeoutExpired:
            raise LinesideError(f"ssh to {self.host} timed out; check the network and retry (push resumes)") from None
        if p.returncode == 255:
            raise LinesideError(ssh_failure(self.host, p.stderr, self.login))
        if check and p.returncode != 0:
            last = (p.stderr.strip().splitlines() or [p.stdout.strip() or "no message"])[-1]
            raise LinesideError(f"command on {self.host} failed ({last})")
        return p

    def command(self, script: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a shell command on the device and return it whatever its exit status (ssh's own failure still raises)."""
        return self._run(script, stdin, check=False)

    def prepare(self) -> None:
        """Create versions/ and list what is installed there (one round trip)."""
        script = (f"mkdir -p -- {self._q}/versions && cd {self._q}/versions && for d in */; do "
                  "[ -f \"$d/manifest.json\" ] || continue; "
                  "printf '%s %s\\n' \"$(sha256sum < \"$d/manifest.json\" | cut -d' ' -f1)\" \"${d%/}\"; done")
        out = self._run(script).stdout
        self._installed = {name: sha for sha, name in (ln.split(" ", 1) for ln in out.splitlines() if " " in ln)}

    def space(self, staging: str) -> tuple[int, int]:
        """(bytes free where versions/ lives, bytes already in versions/<staging>), by df and du on the device."""
        out = self._run(f"cd {self._q}/versions && df -Pk . | tail -n 1 && "
                        f"{{ du -sk -- {shlex.quote(staging)} 2>/dev/null || echo 0; }}").stdout.splitlines()
        try:
            return int(out[0].split()[3]) * 1024, int(out[1].split()[0]) * 1024
        except (IndexError, ValueError):
            raise LinesideError(f"cannot read the free space on {self.host} (df printed {out[:1]})") from None

    def close(self) -> None:
        """Stop the shared connection (it would otherwise linger ControlPersist seconds)."""
        subprocess.run([*self.ssh, "-O", "exit", self.host], capture_output=True, timeout=30)

    def installed_versions(self) -> dict[str, str]:
        return dict(self._installed)

    def upload(self, src: Path, staging: str, files: list[str], progress: Progress | None) -> dict[str, int]:
        dest = f"{self.rsync_host}:{self.root}/versions/{staging}/"
        cmd = ["rsync", "--protect-args", "--partial", "--append-verify", "--stats", "--files-from=-", "--chmod=Du=rwx,Dgo=rx",
               "-e", shlex.join(self.ssh), f"{src}/", dest]
        try:
            p = subprocess.run(cmd, input="\n".join(files) + "\n", capture_output=True, text=True)
        except FileNotFoundError:
            raise LinesideError("rsync not found on this machine; install it (apt-get install rsync)") from None
        if p.returncode != 0 and "No space left on device" in p.stderr:
            raise DiskFull(p.stderr.strip().splitlines()[0])
        if p.returncode != 0:
            err = " ".join(p.stderr.strip().splitlines()[-2:]) or f"exit {p.returncode}"
            hint = " (is rsync installed on the device?)" if "command not found" in p.stderr else ""
            raise LinesideError(f"rsync to {self.host} failed: {err}{hint}; run push again to resume")
        m = re.search(r"Literal data: ([\d,]+) bytes", p.stdout)
        sent = int(m.group(1).replace(",", "")) if m else 0
        if progress:
            progress(sent)
        return {"bytes_sent": sent, "resumed_files": -1}  # rsync does not report appended files

    def remove_staging(self, staging: str) -> None:
        self._run(f"rm -rf -- {self._q}/versions/{shlex.quote(staging)}")

    def verify(self, staging: str, expected: dict[str, str]) -> list[str]:
        listing = "".join(f"{sha}  {rel}\n" for rel, sha in expected.items())
        p = self._run(f"cd {self._q}/versions/{shlex.quote(staging)} && sha256sum --check --strict -",
                      stdin=listing, check=False)
        bad = []
        for line in (p.stdout + "\n" + p.stderr).splitlines():
            m = re.match(r"(?:sha256sum: )?(.+?): (FAILED.*|No such file or directory)$", line)
            if m and m.group(1) in expected:
                bad.append(m.group(1))
        if p.returncode != 0 and not bad:
            raise LinesideError(f"checksum verification on {self.host} failed: {p.stderr.strip()[-200:]}")
        return sorted(set(bad))

    def discard(self, staging: str, files: list[str]) -> None:
        if files:
            names = " ".join(shlex.quote(f) for f in files)
            self._run(f"cd {self._q}/versions/{shlex.quote(staging)} && rm -f -- {names}")

    def finalize(self, staging: str, version: str) -> None:
        self._run(f"cd {self._q}/versions && mv -T -- {shlex.quote(staging)} {shlex.quote(version)}")

    def links(self) -> tuple[str | None, str | None]:
        out = self._run(f"cd {self._q} && for n in current previous; do readlink \"$n\" || echo; done",
                        check=False).stdout.split("\n")
        cur, prev = (out + ["", ""])[:2]
        return cur.strip() or None, prev.strip() or None

    def read_text(self, rel: str) -> str:
        """A small file under the root (a manifest), as text; empty when it cannot be read."""
        return self._run(f"cat -- {self._q}/{shlex.quote(rel)}", check=False).stdout

    def exists(self, rel: str) -> bool:
        return self._run(f"test -f {self._q}/{shlex.quote(rel)}/manifest.json", check=False).returncode == 0

    def switch(self, current: str, previous: str | None) -> None:
        parts = [f"cd {self._q}"]
        for name, target in (("previous", previous), ("current", current)):
            if target is None:
                continue
            parts.append(f"if [ -e {name} ] && [ ! -L {name} ]; then echo '{name} is not a symlink' >&2; exit 3; fi")
            parts.append(f"ln -sfn -- {shlex.quote(target)} .{name}.tmp && mv -Tf -- .{name}.tmp {name}")
        parts.append("(sync . 2>/dev/null || sync)")
        self._run(" && ".join(parts))


def ssh_failure(host: str, stderr: str, login: str = "") -> str:
    """One line for an ssh that exited 255: a changed or unknown host key and a refused login each say what to do,
    since BatchMode (no prompts) turns both into a bare failure."""
    last = (stderr.strip().splitlines() or ["no message"])[-1].strip()
    name, login = host.rpartition("@")[2], login or f"ssh {host}"
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr:
        fix = re.search(r"ssh-keygen -f .+ -R \S+", stderr)
        remove = fix.group(0).strip() if fix else f"ssh-keygen -R {name}"
        return (f"the ssh host key of {host} has changed since it was accepted (a reinstalled device, or another "
                f"machine at that address); if that is expected, run `{remove}`, then `{login}` once to accept "
                "the new key, and push again")
    if "Host key verification failed" in stderr:
        return (f"the ssh host key of {host} is not known here and push cannot ask (BatchMode); run `{login}` "
                "once to check and accept it, then push again")
    if "Permission denied" in stderr or "Too many authentication failures" in stderr:
        return (f"ssh login to {host} was refused ({last}); push logs in without prompting (BatchMode): install "
                f"your key with `ssh-copy-id {host}`, or name one with --ssh 'ssh -i KEY'")
    return f"cannot reach {host} over ssh ({last}); check the address, port and keys"


_REMOTE = re.compile(r"^(?P<host>(?:[^@/:\s]+@)?[^@/:\s]+):(?P<path>.+)$")


_REMOTE_V6 = re.compile(r"^(?P<host>(?:[^@/:\s\[\]]+@)?)\[(?P<addr>[0-9A-Fa-f:.]+(?:%[\w.-]+)?)\]:(?P<path>.+)$")
_HALF_REMOTE = re.compile(r"^(?:[^@/:\s]+@)?[^@/:\s]+:$|^[^@/:\s]*@:")  # user@host: (no dir), user@:/dir (no host)


def _bracketed(host: str) -> str:
    """[user@]host with an IPv6 address in brackets (how rsync and URLs take it)."""
    user, at, addr = host.rpartition("@")
    return f"{user}{at}[{addr}]" if ":" in addr else host


def open_target(target: str, ssh: str = "ssh") -> LocalTarget | SshTarget:
    """`user@host:/dir` -> SshTarget; anything else is a local or mounted directory (but not a half-written ssh
    target, which would otherwise become a local directory named like it)."""
    if _HALF_REMOTE.match(target) and not os.path.exists(target):
        missing = "host" if "@:" in target else "directory on the host"
        raise LinesideError(f"TARGET {target!r} names no {missing}; give user@host:/opt/lineside (or a local "
                            "directory)")
    if target.startswith("ssh://"):
        u = urllib.parse.urlsplit(target)
        if not u.hostname or not u.path.strip("/"):
            raise LinesideError(f"TARGET {target!r}: give ssh://user@host[:port]/dir")
        try:
            port = u.port
        except ValueError:
            raise LinesideError(f"TARGET {target!r}: the port is not a number in 1..65535") from None
        user = urllib.parse.unquote(u.username) + "@" if u.username else ""
        return SshTarget(user + u.hostname, urllib.parse.unquote(u.path), ssh, port=port)
    m6 = _REMOTE_V6.match(target)  # [user@][v6 address]:/dir, as scp and rsync write it
    m = m6 or _REMOTE.match(target)
    if m and not os.path.exists(target):
        host = m.group("host") + m6.group("addr") if m6 else m.group("host")
        port = re.match(r"(\d+):(.*)", m.group("path"))
        if port:  # scp has no port in TARGET: this would be the directory ~/2222:/opt/lineside on the device
            raise LinesideError(f"TARGET {target!r} puts a port before the directory; write "
                                f"ssh://{_bracketed(host)}:{port.group(1)}{port.group(2)} (or keep host:/dir and pass "
                                f"--ssh \"ssh -p {port.group(1)}\")")
        return SshTarget(host, m.group("path"), ssh)
    return LocalTarget(Path(target))

"""Every command in the user's guide (docs/guide/) runs, so the guide cannot rot.

Conventions of the guide's fenced blocks (the first word is the language,
the rest are marks this test reads; Markdown renderers ignore them):

* ```` ```sh ````: run with bash in the guide's working directory; must exit 0.
* ```` ```sh background ````: a long-running process (server, controller,
  agent, testbed): started, ready when it says so (READY below), stopped with
  Ctrl-C (SIGINT) at the end of its page, and it must then exit with 0.
* ```` ```sh fails ````: must exit with a non-zero status and no traceback.
* ```` ```sh root ````: needs root (skipped, with the reason, without it).
* ```` ```sh norun REASON ````: shown, not run (installing, systemd,
  Kubernetes); the reason is required and the list is kept tiny.
* ```` ```python file=NAME ```` / ```` ```toml file=NAME ````: written to NAME
  before the next command. A python block without file= is not allowed: code
  in the guide runs.
* ```` ```text output ````: lines the previous command must print (stdout or
  stderr; a background one, by the time it is ready), in this order; ``...``
  matches anything.
* ```` ```text source ````: messages the code raises that a command here cannot
  provoke; each line's fixed parts must appear in mlfabric's source.

To run on one machine, ports the guide uses (7070, ...) are replaced by free
ports and the example cluster's addresses 10.0.0.N by loopback addresses
127.0.0.N, consistently in commands, files and expected output. Pages run
in the order of the guide's index, in one directory.
"""

from __future__ import annotations

import fnmatch
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support import free_port

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"
PAGES = ["quickstart.md", "deploying.md", "troubleshooting.md", "security.md"]
# Every port number the guide's commands use; each is replaced by a free port.
GUIDE_PORTS = (2379, 2380, 7070, 7071, 7080, 7400, 9100, 9101, 9470, 9471, 9472)
MAX_NORUN = 6
COMMAND_TIMEOUT = 120.0  # bounded, and generous: the suite may share its CPUs
READY_TIMEOUT = 30.0
# What each long-running command prints once it is ready.
READY = re.compile(r"serving job|ready on|press Ctrl-C|ready to serve client requests")

FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    marks: list[str]
    text: str
    output: Block | None = None  # the ```text output block after a command

    @property
    def where(self) -> str:
        return f"docs/guide/{self.page}:{self.line}"

    def mark(self, name: str) -> bool:
        return name in self.marks

    def attr(self, name: str) -> str | None:
        for m in self.marks:
            if m.startswith(name + "="):
                return m.split("=", 1)[1]
        return None


def parse(page: str) -> list[Block]:
    blocks: list[Block] = []
    lines = (GUIDE / page).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"docs/guide/{page}:{start + 1}: unclosed code block"
        block = Block(page, start + 1, m.group(1), m.group(2).split(), "\n".join(body) + "\n")
        if block.lang == "text" and block.mark("output"):
            previous = blocks[-1] if blocks else None
            assert previous is not None and previous.lang == "sh", (
                f"{block.where}: an output block must follow a sh block")
            previous.output = block
        blocks.append(block)
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in parse(page)]


# --- the conventions themselves ---------------------------------------------------


def test_the_guide_index_links_every_page_and_readme_links_the_guide():
    index = (GUIDE / "README.md").read_text()
    pages = sorted(p.name for p in GUIDE.glob("*.md") if p.name != "README.md")
    for page in pages:
        assert f"({page})" in index, f"docs/guide/README.md does not link {page}"
    assert [p for p in PAGES if f"({p})" in index] == PAGES
    assert "docs/guide/README.md" in (ROOT / "README.md").read_text()


def test_every_block_follows_the_conventions():
    norun = []
    for b in [b for page in sorted(p.name for p in GUIDE.glob("*.md")) for b in parse(page)]:
        if b.lang in ("sh", "bash", "shell", "console"):
            assert b.lang == "sh", f"{b.where}: write shell commands as ```sh blocks"
            assert b.page in PAGES, f"{b.where}: a command on a page the test does not run"
            known = {"background", "fails", "root", "norun"}
            assert b.marks[:1] == ["norun"] or set(b.marks) <= known, (
                f"{b.where}: unknown marks {b.marks}; use {sorted(known)}")
            if b.mark("norun"):
                assert len(b.marks) > 1, f"{b.where}: norun needs a reason after it"
                norun.append(b.where)
            for port in re.findall(r"(?::|--metrics-port[ =])(\d{4,5})\b", b.text):
                assert int(port) in GUIDE_PORTS, (
                    f"{b.where}: port {port} is not in GUIDE_PORTS of tests/test_guide.py")
        elif b.lang == "python":
            assert b.attr("file"), f"{b.where}: a python block must be a file= the guide runs"
    assert len(norun) <= MAX_NORUN, f"too many blocks not run: {norun}"


def test_quoted_source_messages_are_still_in_the_code():
    source = "\n".join(p.read_text() for p in sorted((ROOT / "src" / "mlfabric").rglob("*.py")))
    # Join string literals continued on the next line ("...a " f"b...").
    source = re.sub(r"[\"']\s*\n\s*f?[\"']", "", source)
    source = " ".join(source.split())
    quoted = [b for b in all_blocks() if b.lang == "text" and b.mark("source")]
    assert quoted, "the troubleshooting page quotes no messages"
    for b in quoted:
        for line in filter(None, (x.strip() for x in b.text.splitlines())):
            for part in (p.strip() for p in line.split("...")):
                if len(part) >= 6:
                    assert part in source, (
                        f"{b.where}: {part!r} is no longer in mlfabric's source")


# --- running the guide ------------------------------------------------------------


@dataclass
class Substitutions:
    ports: dict[int, int] = field(default_factory=dict)

    def __call__(self, text: str) -> str:
        for port in GUIDE_PORTS:
            if re.search(rf"\b{port}\b", text):
                new = self.ports.setdefault(port, free_port())
                text = re.sub(rf"\b{port}\b", str(new), text)
        # The example cluster's hosts 10.0.0.N become loopback addresses.
        return re.sub(r"\b10\.0\.0\.(\d+)\b", r"127.0.0.\1", text)


class Background:
    def __init__(self, block: Block, command: str, env: dict[str, str], cwd: Path) -> None:
        self.block = block
        self.proc = subprocess.Popen(
            ["bash", "-c", "exec " + command.strip()], cwd=cwd, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(READY_TIMEOUT):
            self.kill()
            pytest.fail(f"{block.where}: not ready within {READY_TIMEOUT:g} s: {command}\n"
                        + "".join(self.lines))
        if self.proc.poll() is not None:
            pytest.fail(f"{block.where}: exited with {self.proc.returncode} at start:\n"
                        + "".join(self.lines))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if READY.search(line):
                self.ready.set()
        self.ready.set()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # Ctrl-C, as in a terminal
        try:
            code = self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.block.where}: did not stop within 15 s of Ctrl-C (SIGINT)")
        # etcd, like many Go servers, ends by raising the signal again once it
        # has shut down: only mlfabric's own commands must exit 0.
        ours = self.block.text.lstrip().startswith(("mlfabric", "python"))
        assert code == 0 or (not ours and code == -signal.SIGINT), (
            f"{self.block.where}: exited with {code} on Ctrl-C (SIGINT):\n"
            + "".join(self.lines))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def check_output(block: Block, expected: Block, output: str, subst: Substitutions) -> None:
    # Runs of spaces count as one: table columns widen with longer addresses.
    got = [" ".join(line.split()) for line in output.splitlines()]
    at = 0
    for want in filter(None, subst(expected.text).splitlines()):
        pattern = "*".join(glob_escape(" ".join(p.split())) for p in want.split("..."))
        for i in range(at, len(got)):
            if fnmatch.fnmatchcase(got[i], pattern):
                at = i + 1
                break
        else:
            pytest.fail(f"{expected.where}: {block.where} did not print (in this order)\n"
                        f"  {want}\nIt printed:\n{output}")


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def run_command(block: Block, command: str, env: dict[str, str], cwd: Path,
                subst: Substitutions) -> None:
    try:
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=cwd, env=env,
                              text=True, capture_output=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: did not finish within {COMMAND_TIMEOUT:g} s: {command}")
    output = proc.stdout + proc.stderr
    if block.mark("fails"):
        assert proc.returncode != 0, f"{block.where}: was expected to fail:\n{output}"
        assert "Traceback" not in output, f"{block.where}: a traceback, not a message:\n{output}"
    else:
        assert proc.returncode == 0, (
            f"{block.where}: exit status {proc.returncode}:\n$ {command}\n{output}")
    if block.output is not None:
        check_output(block, block.output, output, subst)


def test_every_command_in_the_guide_runs(tmp_path):
    is_root = os.geteuid() == 0
    bindir = str(Path(sys.executable).parent)  # the installed `mlfabric` and `python`
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MLFABRIC_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    subst = Substitutions()
    ran = 0
    for page in PAGES:
        running: list[Background] = []
        # A page that makes a token or key makes it afresh (a reader of that
        # page alone has none; `mlfabric token` keeps an existing file); the
        # pages share their other files (model.npz, and job.token for the
        # troubleshooting page).
        for block in parse(page):
            for made in re.findall(r"mlfabric token (?:new|agent-key)\b[^\n#]*?(\S+)\s*(?:#|$)",
                                   block.text, flags=re.M):
                (tmp_path / made).unlink(missing_ok=True)
        try:
            for block in parse(page):
                name = block.attr("file")
                if name is not None:
                    (tmp_path / name).write_text(subst(block.text))
                    continue
                if block.lang != "sh" or block.mark("norun"):
                    continue
                if block.mark("root") and not is_root:
                    continue
                command = subst(block.text)
                if block.mark("background"):
                    running.append(Background(block, command, env, tmp_path))
                    if block.output is not None:  # what it printed up to being ready
                        check_output(block, block.output, "".join(running[-1].lines), subst)
                else:
                    run_command(block, command, env, tmp_path, subst)
                ran += 1
        finally:
            errors = []
            for bg in reversed(running):
                try:
                    bg.stop()
                except BaseException as exc:  # stop the others before reporting
                    errors.append(exc)
                    bg.kill()
            if errors:
                raise errors[0]
    assert ran >= 20, f"only {ran} commands ran"

#!/usr/bin/env python3
"""Reads the repository's Dockerfile and prints what migdra-images.sh must do to build the
same images without a Docker daemon, one tab-separated record a line:

    base    <stage> <debian release>
    cargo   <stage> <cargo command> <binary>...        (a rust:* builder stage)
    go      <stage> <context dir> <output>...           (a golang:* builder stage)
    image   <stage> <name> <image config JSON>
    copy    <stage> <from stage> <source> <destination>

It understands exactly the instructions the Dockerfile uses and stops with an error naming the
line of anything else, so that the Dockerfile and the daemonless build cannot drift apart:
whatever this parser accepts, migdra-images.sh reproduces.

With --context-digest it prints a sha256 over the build context instead (see
context_digest), the key under which migdra-images.sh caches what the cargo build made.

Image names come from the header's `docker build --target <stage> -t <name> .` lines; every
stage that no other stage builds on needs one.
"""

import copy
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys

# The config of Debian's official debian:<release>-slim images, which the runtime stages
# start from.
DEBIAN_SLIM_CONFIG = {
    "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    "Cmd": ["bash"],
}


class DockerfileError(Exception):
    pass


def logical_lines(text):
    """(line number, instruction line) with continuations joined and comments dropped."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        out.append((start, buf))
        buf = ""
    if buf:
        raise DockerfileError(f"line {start}: continuation at the end of the file")
    return out


def image_names(text):
    names = {}
    for m in re.finditer(r"^#\s+docker build --target (\S+)\s+-t (\S+) \.$", text, re.M):
        names[m.group(1)] = m.group(2)
    return names


def substitute(value, args, n):
    def var(m):
        name = m.group(1) or m.group(2)
        if name not in args:
            raise DockerfileError(f"line {n}: unknown build argument {name}")
        return args[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", var, value)


def key_values(rest, n, what):
    pairs = []
    for token in shlex.split(rest):
        if "=" not in token:
            raise DockerfileError(f"line {n}: {what} needs key=value pairs, got {token!r}")
        key, value = token.split("=", 1)
        pairs.append((key, value))
    return pairs


def plan(text):
    names = image_names(text)
    args = {}
    stages = {}  # name -> dict
    order = []
    current = None
    for n, line in logical_lines(text):
        word, _, rest = line.partition(" ")
        instr = word.upper()
        rest = rest.strip()
        if instr == "ARG" and current is None:
            key, _, value = rest.partition("=")
            args[key] = value
            continue
        if instr == "FROM":
            m = re.fullmatch(r"(\S+) AS (\S+)", rest, re.I)
            if not m:
                raise DockerfileError(f"line {n}: FROM needs a stage name (FROM <image> AS <stage>)")
            source, name = substitute(m.group(1), args, n), m.group(2)
            current = {"name": name, "line": n, "source": source, "instructions": []}
            if source in stages:
                parent = stages[source]
                if parent["kind"] != "runtime":
                    raise DockerfileError(f"line {n}: stage {name} builds on builder stage {source}")
                current.update(kind="runtime", parent=source)
                parent["has_children"] = True
                current["release"] = parent["release"]
            elif m2 := re.fullmatch(r"debian:(\w+)-slim", source):
                current.update(kind="runtime", config=copy.deepcopy(DEBIAN_SLIM_CONFIG),
                               copies=[], release=m2.group(1))
            elif re.fullmatch(r"rust:[\w.-]+", source):
                current["kind"] = "cargo"
            elif re.fullmatch(r"golang:[\w.-]+", source):
                current["kind"] = "go"
            else:
                raise DockerfileError(f"line {n}: base image {source} is none of debian:<release>-slim, rust:*, golang:*")
            stages[name] = current
            order.append(name)
            continue
        if current is None:
            raise DockerfileError(f"line {n}: {instr} before the first FROM")
        current["instructions"].append((n, instr, rest))

    records = []
    for name in order:
        stage = stages[name]
        if stage["kind"] == "cargo":
            records.append(cargo_stage(stage))
        elif stage["kind"] == "go":
            records.append(go_stage(stage))
        else:
            if "parent" in stage:
                parent = stages[stage["parent"]]
                stage["config"] = copy.deepcopy(parent["config"])
                stage["copies"] = list(parent["copies"])
            runtime_stage(stage)
    releases = {stages[s]["release"] for s in order if stages[s]["kind"] == "runtime"}
    if len(releases) != 1:
        raise DockerfileError(f"the runtime stages must share one Debian release, found {sorted(releases)}")
    records.insert(0, ["base", next(s for s in order if stages[s]["kind"] == "runtime"), releases.pop()])
    for name in order:
        stage = stages[name]
        if stage["kind"] != "runtime" or stage.get("has_children"):
            continue
        if name not in names:
            raise DockerfileError(f"stage {name} has no `docker build --target {name} -t <name> .` line in the header")
        config = dict(stage["config"])
        if not config.get("Labels"):
            config.pop("Labels", None)
        records.append(["image", name, names[name], json.dumps(config, sort_keys=True, separators=(",", ":"))])
        for from_stage, src, dst in stage["copies"]:
            if from_stage not in stages or stages[from_stage]["kind"] == "runtime":
                raise DockerfileError(f"stage {name} copies from {from_stage}, which is no builder stage")
            outputs = next(r for r in records if r[1] == from_stage)[3:]
            if not src.startswith("/out/") or src[len("/out/"):] not in outputs:
                raise DockerfileError(f"stage {name} copies {src} from {from_stage}, which builds only {outputs} under /out")
            records.append(["copy", name, from_stage, src, dst])
    for name in names:
        if name not in stages:
            raise DockerfileError(f"the header names stage {name}, which does not exist")
    return records


def cargo_stage(stage):
    """A rust:* builder: WORKDIR /src, COPY . ., and one RUN whose cargo build command the
    script runs in the repository and whose cp lines name the binaries it puts in /out."""
    expected = [("WORKDIR", "/src"), ("COPY", ". .")]
    got = [(i, r) for _, i, r in stage["instructions"]]
    if got[:2] != expected or len(got) != 3 or got[2][0] != "RUN":
        raise DockerfileError(
            f"line {stage['line']}: builder stage {stage['name']} must be WORKDIR /src, COPY . ., one RUN")
    run = re.sub(r"--mount=\S+\s*", "", got[2][1]).strip()
    parts = [p.strip() for p in run.split("&&")]
    if len(parts) != 3 or not parts[0].startswith("cargo build ") or parts[1] != "mkdir -p /out":
        raise DockerfileError(
            f"line {stage['line']}: builder stage {stage['name']}'s RUN must be `cargo build ... && mkdir -p /out && cp target/release/<bin>... /out/`")
    cp = shlex.split(parts[2])
    if cp[0] != "cp" or cp[-1] != "/out/" or not all(a.startswith("target/release/") for a in cp[1:-1]):
        raise DockerfileError(f"line {stage['line']}: cannot read the binaries of `{parts[2]}`")
    if "--release" not in shlex.split(parts[0]):
        raise DockerfileError(f"line {stage['line']}: the cargo build is not --release")
    return ["cargo", stage["name"], parts[0]] + [a[len("target/release/"):] for a in cp[1:-1]]


def go_stage(stage):
    """A golang:* builder: WORKDIR /src, COPY <dir>/ ./, RUN ./build.sh /out; the script runs
    <dir>/build.sh, whose output is the directory's one binary named by its tools.go."""
    got = [(i, r) for _, i, r in stage["instructions"]]
    if len(got) != 3 or got[0] != ("WORKDIR", "/src") or got[1][0] != "COPY" or got[2] != ("RUN", "./build.sh /out"):
        raise DockerfileError(
            f"line {stage['line']}: builder stage {stage['name']} must be WORKDIR /src, COPY <dir>/ ./, RUN ./build.sh /out")
    m = re.fullmatch(r"([\w./-]+)/ \./", got[1][1])
    if not m:
        raise DockerfileError(f"line {stage['line']}: builder stage {stage['name']}: COPY <dir>/ ./ expected")
    tools = open(f"{m.group(1)}/tools.go").read()
    binaries = re.findall(r'_ "[^"]+/cmd/([\w-]+)"', tools)
    if len(binaries) != 1:
        raise DockerfileError(f"{m.group(1)}/tools.go must pin exactly one cmd/<binary>")
    return ["go", stage["name"], m.group(1)] + binaries


def runtime_stage(stage):
    config = stage["config"]
    for n, instr, rest in stage["instructions"]:
        if instr == "LABEL":
            config.setdefault("Labels", {}).update(key_values(rest, n, "LABEL"))
        elif instr == "ENV":
            env = [e for e in config.get("Env", [])]
            for key, value in key_values(rest, n, "ENV"):
                env = [e for e in env if not e.startswith(key + "=")] + [f"{key}={value}"]
            config["Env"] = env
        elif instr == "USER":
            if not re.fullmatch(r"\d+(:\d+)?", rest):
                raise DockerfileError(f"line {n}: USER must be numeric uid[:gid], got {rest!r}")
            config["User"] = rest
        elif instr == "WORKDIR":
            if not rest.startswith("/") or " " in rest:
                raise DockerfileError(f"line {n}: WORKDIR must be one absolute path")
            config["WorkingDir"] = rest
        elif instr == "ENTRYPOINT":
            try:
                entrypoint = json.loads(rest)
            except json.JSONDecodeError:
                entrypoint = None
            if not isinstance(entrypoint, list) or not all(isinstance(a, str) for a in entrypoint):
                raise DockerfileError(f"line {n}: ENTRYPOINT must be the exec (JSON array) form")
            config["Entrypoint"] = entrypoint
            # As in docker build: a stage's ENTRYPOINT drops the Cmd of the image it builds on.
            config.pop("Cmd", None)
        elif instr == "COPY":
            tokens = shlex.split(rest)
            if len(tokens) != 3 or not tokens[0].startswith("--from="):
                raise DockerfileError(f"line {n}: only COPY --from=<stage> <file> <absolute path> is supported")
            src, dst = tokens[1], tokens[2]
            if not dst.startswith("/") or dst.endswith("/"):
                raise DockerfileError(f"line {n}: COPY destination must be an absolute file path")
            stage["copies"].append((tokens[0][len("--from="):], src, dst))
        else:
            raise DockerfileError(
                f"line {n}: {instr} in runtime stage {stage['name']}: migdra-images.sh does not reproduce it")


def ignore_regex(pattern):
    """A .dockerignore pattern as a regex over slash-separated relative paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def context_digest():
    """sha256 over the build context docker build would send: the files git lists (tracked and
    untracked, not ignored) minus what .dockerignore excludes, names and contents."""
    patterns = []
    with open(".dockerignore") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("!"):
                raise DockerfileError(f".dockerignore: exceptions ({line}) are not supported")
            patterns.append(ignore_regex(line.strip("/")))
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    digest = hashlib.sha256()
    for path in sorted(p for p in listed if p):
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(r.fullmatch(p) for r in patterns for p in prefixes) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            digest.update(path.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def main():
    if sys.argv[1:] == ["--context-digest"]:
        try:
            print(context_digest())
        except (DockerfileError, OSError, subprocess.CalledProcessError) as e:
            print(f"dockerfile_plan.py: {e}", file=sys.stderr)
            return 1
        return 0
    if len(sys.argv) != 2:
        print("usage: dockerfile_plan.py DOCKERFILE | --context-digest (run in the build context)", file=sys.stderr)
        return 2
    try:
        with open(sys.argv[1]) as f:
            records = plan(f.read())
    except (DockerfileError, OSError) as e:
        print(f"dockerfile_plan.py: {sys.argv[1]}: {e}", file=sys.stderr)
        return 1
    for record in records:
        print("\t".join(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())

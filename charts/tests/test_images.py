"""The Dockerfile, the chart and e2e/runtime/migdra-images.sh (the daemonless build of the same
images) agree: the images are named as the chart pulls them, the plugin image ships
nvidia-cdi-hook, and any Dockerfile instruction the daemonless build would not reproduce is
refused by its parser (e2e/runtime/dockerfile_plan.py) with the line that has it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import CHART, REPO

PLAN = REPO / "e2e" / "runtime" / "dockerfile_plan.py"
DOCKERFILE = (REPO / "Dockerfile").read_text()


def run_plan(text: str, tmp_path) -> subprocess.CompletedProcess:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(text)
    # The go stage reads its directory's tools.go relative to the build context.
    return subprocess.run([sys.executable, str(PLAN), str(dockerfile)], cwd=REPO,
                          capture_output=True, text=True)


def records(text: str, tmp_path) -> list[list[str]]:
    result = run_plan(text, tmp_path)
    assert result.returncode == 0, result.stderr
    return [line.split("\t") for line in result.stdout.splitlines()]


def refused(text: str, tmp_path) -> str:
    result = run_plan(text, tmp_path)
    assert result.returncode == 1, f"accepted:\n{result.stdout}"
    return result.stderr


def images(recs):
    return {r[1]: (r[2], json.loads(r[3])) for r in recs if r[0] == "image"}


def copies(recs, stage):
    return {r[4]: (r[2], r[3]) for r in recs if r[0] == "copy" and r[1] == stage}


def test_images_have_the_names_the_chart_pulls(tmp_path):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    names = {stage: name for stage, (name, _) in images(records(DOCKERFILE, tmp_path)).items()}
    tag = chart["appVersion"]
    assert names["controller"] == f"{values['controller']['image']['repository']}:{tag}"
    assert names["kubelet-plugin"] == f"{values['kubeletPlugin']['image']['repository']}:{tag}"
    assert set(names) == {"controller", "kubelet-plugin", "kubectl-migdra"}


def test_every_image_runs_its_binary_on_the_debian_base(tmp_path):
    recs = records(DOCKERFILE, tmp_path)
    assert recs[0] == ["base", "runtime-base", "bookworm"]
    cargo = next(r for r in recs if r[0] == "cargo")
    assert "--locked" in cargo[2].split()
    for stage, (_, config) in images(recs).items():
        binary = config["Entrypoint"][0]
        assert copies(recs, stage)[binary][0] == "builder"
        assert binary.rsplit("/", 1)[1] in cargo[3:]
        assert config["Labels"]["org.opencontainers.image.source"] == "https://github.com/migdra/migdra"
        assert "Cmd" not in config, "an ENTRYPOINT drops the base's Cmd"
    assert images(recs)["controller"][1]["User"] == "65532:65532"
    assert "User" not in images(recs)["kubelet-plugin"][1]


def test_plugin_image_ships_nvidia_cdi_hook(tmp_path):
    recs = records(DOCKERFILE, tmp_path)
    assert ["go", "cdi-hook", "kubelet-plugin/cdi-hook", "nvidia-cdi-hook"] in recs
    assert copies(recs, "kubelet-plugin")["/usr/local/bin/nvidia-cdi-hook"] == (
        "cdi-hook", "/out/nvidia-cdi-hook")
    assert "/usr/local/bin/nvidia-cdi-hook" not in copies(recs, "controller")


def test_builders_and_runtime_use_one_debian_release():
    assert "ARG DEBIAN_RELEASE=bookworm" in DOCKERFILE
    froms = [line for line in DOCKERFILE.splitlines() if line.startswith("FROM ")]
    for line in froms:
        assert "${DEBIAN_RELEASE}" in line or line.split()[1] == "runtime-base", line


def append_to_stage(stage: str, instruction: str) -> str:
    """The Dockerfile with instruction added at the end of stage's block."""
    lines = DOCKERFILE.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("FROM ") and l.endswith(f" AS {stage}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("FROM ")), len(lines))
    while not lines[end - 1].strip() or lines[end - 1].startswith("#"):
        end -= 1
    return "\n".join(lines[:end] + [instruction] + lines[end:]) + "\n"


@pytest.mark.parametrize("instruction, message", [
    ("RUN apt-get install -y pciutils", "RUN in runtime stage kubelet-plugin"),
    ("ADD https://example.com/x /x", "ADD in runtime stage kubelet-plugin"),
    ("EXPOSE 8080", "EXPOSE in runtime stage kubelet-plugin"),
    ("VOLUME /var/lib/x", "VOLUME in runtime stage kubelet-plugin"),
    ("COPY charts/migdra /chart", "only COPY --from=<stage>"),
    ("COPY --chmod=755 --from=builder /out/migdra-controller /x", "only COPY --from=<stage>"),
    ("COPY --from=builder /out/not-built /usr/local/bin/x", "builds only"),
    ("ENTRYPOINT /usr/local/bin/migdra-kubelet-plugin", "exec (JSON array) form"),
    ("USER nobody", "USER must be numeric"),
])
def test_instructions_the_daemonless_build_does_not_reproduce_are_refused(tmp_path, instruction, message):
    text = append_to_stage("kubelet-plugin", instruction)
    error = refused(text, tmp_path)
    assert message in error
    line = text.splitlines().index(instruction) + 1
    assert f"line {line}:" in error or "builds only" in error


def test_instructions_it_reproduces_go_into_the_image_config(tmp_path):
    text = append_to_stage("kubelet-plugin", 'ENV RUST_BACKTRACE=1 MIGDRA_X="a b"\nWORKDIR /var/lib/migdra\nLABEL extra=yes')
    config = images(records(text, tmp_path))["kubelet-plugin"][1]
    assert config["Env"][-2:] == ["RUST_BACKTRACE=1", "MIGDRA_X=a b"]
    assert config["WorkingDir"] == "/var/lib/migdra"
    assert config["Labels"]["extra"] == "yes"
    assert "WorkingDir" not in images(records(text, tmp_path))["controller"][1]


def test_a_stage_without_a_name_in_the_header_is_refused(tmp_path):
    text = DOCKERFILE.replace("#   docker build --target kubectl-migdra", "#   (no build line)")
    assert "stage kubectl-migdra has no `docker build --target kubectl-migdra" in refused(text, tmp_path)


def test_builder_stages_must_keep_their_known_shape(tmp_path):
    text = DOCKERFILE.replace("COPY kubelet-plugin/cdi-hook/ ./\nRUN ./build.sh /out",
                              "COPY kubelet-plugin/cdi-hook/ ./\nRUN go build -o /out/x ./...")
    assert "builder stage cdi-hook must be" in refused(text, tmp_path)
    text = DOCKERFILE.replace("cargo build --release --locked", "cargo build --locked")
    assert "not --release" in refused(text, tmp_path)
    text = DOCKERFILE.replace("FROM debian:${DEBIAN_RELEASE}-slim AS runtime-base",
                              "FROM gcr.io/distroless/cc AS runtime-base")
    assert "gcr.io/distroless/cc is none of" in refused(text, tmp_path)

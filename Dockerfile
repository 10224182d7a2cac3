# The mlfabric image: one image for every `mlfabric` command (agent, server,
# replica, controller, status, report) and for workers running the examples.
#
#   docker build -t mlfabric .                               # no PyTorch
#   docker build -t mlfabric-torch --build-arg EXTRAS=demo,torch .   # workers
#   docker run --rm mlfabric server --help
#
# Two stages: the first compiles the Cython core once into a wheel (it needs
# a C compiler); the second installs that wheel into a slim Python, with no
# compiler and no source tree. The install is the README's (`pip install .`,
# the same pyproject.toml and setup.py), as a wheel; tests/test_deploy.py
# checks the two agree.

ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON}-slim
ARG EXTRAS=demo
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/mlfabric-*.whl)[${EXTRAS}]" \
    && rm -rf /wheels
# The examples, for workers (examples/torch_digits.py under torchrun).
COPY examples /opt/mlfabric/examples
# Nothing here needs root: ports above 1024, state under /var/lib/mlfabric.
RUN useradd --system --uid 10001 --home-dir /var/lib/mlfabric --create-home mlfabric
USER mlfabric
WORKDIR /var/lib/mlfabric
ENTRYPOINT ["mlfabric"]
CMD ["--help"]

# The image `kvstrata cluster render` manifests run: every role (router, worker, mooncake-master,
# mooncake-store) is `python3 -m kvstrata...` in this one image.
#   docker build -t kvstrata:latest .
#   kvstrata cluster render --image kvstrata:latest | kubectl apply -f -
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 KVSTRATA_CACHE_DIR=/var/cache/kvstrata
WORKDIR /opt/kvstrata

COPY scripts/install_system_deps.sh scripts/
RUN bash scripts/install_system_deps.sh serve && rm -rf /var/lib/apt/lists/*   # serving: no test-only packages

# torch first (pinned), so nothing else picks its build; TORCH_INDEX may name a CPU-only or CUDA wheel index
ARG TORCH_INDEX=
RUN pip install "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
COPY pyproject.toml README.md ./
COPY kvstrata kvstrata
RUN pip install ".[mooncake]"

# Build the built-in tiny model into the image, so a pod starts without writing it first.
RUN python3 -c "from kvstrata.model.builtin import resolve_model_path; resolve_model_path('tiny')"

EXPOSE 30000
CMD ["python3", "-m", "kvstrata.launch_server", "--host", "0.0.0.0"]

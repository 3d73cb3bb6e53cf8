# ckptrun on a CPU image. Torch is installed first and on its own, as in the README: pass
# TORCH_SPEC to pick another build (for example a local CPU wheel copied into the context).
FROM python:3.11-slim
ARG TORCH_SPEC=torch==2.13.0
WORKDIR /opt/ckptrun
RUN pip install --no-cache-dir "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY ckptrun ./ckptrun
COPY examples ./examples
COPY recipes ./recipes
RUN pip install --no-cache-dir -e .
# /dev/shm holds the staging slots: give the container enough (docker run --shm-size=2g).
ENTRYPOINT ["ckptrun"]
CMD ["--strategy", "lowdiff", "--dir", "/ckpts", "examples/train_gpt.py", "--steps", "100", "--log-every", "10"]

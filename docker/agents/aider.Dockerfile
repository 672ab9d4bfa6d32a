# aider: a venv at /opt/aider on Debian's python3, built by scripts/build-agent-images.sh.
FROM forgepool-agent-base:bookworm
ADD venv.tar /
COPY bin /usr/local/bin
ENV LITELLM_LOCAL_MODEL_COST_MAP=True PYTHONDONTWRITEBYTECODE=1
USER 10001:10001

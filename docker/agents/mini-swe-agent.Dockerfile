# mini-swe-agent: a venv at /opt/mini-swe-agent on Debian's python3, built by
# scripts/build-agent-images.sh.
FROM forgepool-agent-base:bookworm
ADD venv.tar /
COPY bin /usr/local/bin
ENV LITELLM_LOCAL_MODEL_COST_MAP=True PYTHONDONTWRITEBYTECODE=1 \
    MSWEA_CONFIGURED=true MSWEA_GLOBAL_CONFIG_DIR=/tmp/.config/mini-swe-agent
USER 10001:10001

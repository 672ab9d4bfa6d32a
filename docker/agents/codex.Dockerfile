# Codex CLI: the static musl build of npm @openai/codex@VERSION-linux-x64, laid out as
# the package has it (bin/, codex-path/rg, codex-resources/bwrap), without the voice libraries.
FROM forgepool-agent-base:bookworm
COPY codex /opt/codex
COPY bin /usr/local/bin
USER 10001:10001

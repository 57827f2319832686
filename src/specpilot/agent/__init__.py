"""LLM agents for the pilot loop (``specpilot optimize --agent openai ...``): an OpenAI-compatible
endpoint proposes parameters for existing mechanisms or new mechanisms as Python source, which
run only in sandboxed trial subprocesses and count only after token forcing (docs/agent.md).

Modules (imported on demand; this package imports nothing heavy, since the trial subprocess
imports :mod:`.sandbox` before torch):
  * :mod:`.config`   - :class:`~.config.AgentConfig` (validated);
  * :mod:`.client`   - the chat client: retries, backoff, errors with reasons;
  * :mod:`.prompt`   - what an agent is told each round;
  * :mod:`.parse`    - a reply -> a parameter proposal or a module source;
  * :mod:`.static`   - the static check of agent-written source (never executed here);
  * :mod:`.sandbox`, :mod:`.landlock` - the trial subprocess's sandbox and its detection;
  * :mod:`.store`    - writing sources, describing them in a sandboxed child, stand-ins;
  * :mod:`.explorer` - :class:`~.explorer.AgentExplorer`, the coordinator's hook.
"""

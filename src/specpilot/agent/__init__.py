"""LLM agents for the pilot loop (``specpilot optimize --agent openai ...``): an OpenAI-compatible
endpoint proposes parameters for existing mechanisms or new mechanisms as Python source, which
run only in sandboxed trial subprocesses and count only after token forcing (docs/agent.md).

Modules (imported on demand; this package imports nothing heavy). The trial subprocess's sandbox
is the harness's, :mod:`specpilot.pilot.sandbox`; this package depends on :mod:`specpilot.pilot`
one way, through :class:`specpilot.pilot.explorer.Explorer`:
  * :mod:`.config`   - :class:`~.config.AgentConfig` (validated);
  * :mod:`.client`   - the chat client: retries, backoff, errors with reasons;
  * :mod:`.prompt`   - what an agent is told each round;
  * :mod:`.parse`    - a reply -> a parameter proposal or a module source;
  * :mod:`.static`   - the static check of agent-written source (never executed here);
  * :mod:`.store`    - writing sources, describing them in a sandboxed child, stand-ins;
  * :mod:`.explorer` - :class:`~.explorer.AgentExplorer` (an Explorer) and
    :func:`~.explorer.agent_explorer`, the factory the CLI hands the coordinator.
"""

"""Multi-turn episodes: the environment contract (`api`), tools (`tools`), a built-in game (`games`), observations
as tokens (`render`) and the episode loop over a sampling engine (`episodes`). docs/environments.md."""

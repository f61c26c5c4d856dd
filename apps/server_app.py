"""ServerApp: FedProx over LoRA adapter updates with SecAgg+, writing a run directory.

A ``FlwrVerlError`` (bad config, an unloadable model, a round that failed) ends the run as
failed with one ERROR line naming the problem, instead of a traceback.
"""

from flwr.app import Context
from flwr.server import Grid, ServerApp

from flwr_verl.federation.mods import install_concise_errors
from flwr_verl.federation.server import run_server

install_concise_errors()
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context)

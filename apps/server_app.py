"""ServerApp: FedProx over LoRA adapter updates with SecAgg+, writing a run directory."""

from flwr.app import Context
from flwr.server import Grid, ServerApp

from flwr_verl.server import run_server

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context)

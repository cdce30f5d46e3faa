"""The console: Conveyor's pipeline, fleet and requests in a browser, served by
the gateway at ``/console`` (decision 0033)."""

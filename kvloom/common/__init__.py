"""Code the two daemons share and the client never needs: logging set-up, the
/metrics endpoint, the default-model converter. Installed with `kvloom[server]`."""

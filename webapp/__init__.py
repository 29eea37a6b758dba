"""The Krypton web app: layout, callbacks, helpers and the job manager (Dash)."""

"""The Krypton web app (Dash): the layout, one callback module per panel (panels/), the
services they share, the browser-free run orchestration (runs) and the job
managers (threads here, Celery in team mode)."""

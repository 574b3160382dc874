"""Other ZeRO implementations the engine benchmark runs beside zerotrain (optional installs)."""

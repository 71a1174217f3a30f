# The image the Helm chart runs: one image, two entry points (gateway, scheduler).
FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvgate
# The sources are installed, then removed: run from a directory holding them, `python -m
# gateway` would import that copy instead of the installed one (and compile it at every start
# under a read-only root filesystem).
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY admission admission
COPY gateway gateway
COPY scheduler scheduler
COPY lua lua
RUN pip install --no-cache-dir '.[fast]' && rm -rf /root/.cache /src
WORKDIR /
USER 10001
EXPOSE 8080 9100
ENTRYPOINT ["python", "-m"]
CMD ["gateway", "--config", "/etc/kvgate/config.toml"]

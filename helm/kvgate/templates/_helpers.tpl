{{/*
Names, labels, and the pieces the gateway and scheduler pods share (Redis env, config
volumes). The TOML emitter lives in _toml.tpl.
*/}}

{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Truncated to 52 so that "-scheduler" (and pod hashes) still fit Kubernetes' 63. */}}
{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Call with (dict "root" $ "component" "gateway"). */}}
{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" .root }}
{{ include "kvgate.stableLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
{{- end }}

{{/*
The labels that stay the same from one chart version to the next, for a pod template that
must not change with them: a new label there rolls the pods, and the bundled Redis' pod holds
every queue (in memory only, without persistence).
*/}}
{{- define "kvgate.stableLabels" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end }}

{{- define "kvgate.image" -}}
{{- include "kvgate.imageRef" (dict "image" .Values.image "defaultTag" .Chart.AppVersion) }}
{{- end }}

{{/* Call with (dict "image" $values.image "defaultTag" "..."): a digest wins over the tag. */}}
{{- define "kvgate.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .defaultTag .image.tag) }}
{{- end }}
{{- end }}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- Redis */}}

{{/*
The bundled Redis' Service and StatefulSet: at most 52 characters. A StatefulSet's pods carry
the label controller-revision-hash = its name + "-" + a hash of up to 10 characters, and a
label value over 63 characters makes every pod creation fail (kubernetes/kubernetes#64023).
*/}}
{{- define "kvgate.redis.host" -}}
{{- printf "%s-redis" (include "kvgate.fullname" . | trunc 46 | trimSuffix "-") }}
{{- end }}

{{/*
Refuses combinations that would deploy something that cannot work, with a message naming the
value to change (the schema checks each value alone; these need two).
*/}}
{{- define "kvgate.validate" -}}
{{- if not .Values.image.repository }}
{{- fail "image.repository is required: no public registry publishes kvgate; build the repository's Dockerfile, push it to a registry you control and set image.repository (and image.tag or image.digest)" }}
{{- end }}
{{- $r := .Values.redis }}
{{- if and $r.tls.caSecret (not $r.tls.enabled) }}
{{- fail "redis.tls.caSecret is set but redis.tls.enabled is false: the CA would be ignored (enable TLS with a rediss:// redis.external.url, or unset caSecret)" }}
{{- end }}
{{- if eq $r.mode "external" }}
{{- if not $r.external.url }}
{{- fail "redis.external.url is required when redis.mode is external" }}
{{- end }}
{{- /* The URL is shown in the ConfigMap, the pods' environment and the install notes: the
       credentials come from redis.auth, through a Secret, never from the URL. */}}
{{- if regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@" $r.external.url }}
{{- fail "redis.external.url: a user name or password before the host would show in the ConfigMap, the pods' environment and the install notes: leave it out and set redis.auth (the password in existingSecret, an ACL user in username)" }}
{{- end }}
{{- range (splitList "&" (regexReplaceAll "^[^?]*\\?" $r.external.url "")) }}
{{- $name := (splitList "=" .) | first }}
{{- if and (contains "?" $r.external.url) (has $name (list "username" "password")) }}
{{- fail (printf "redis.external.url: its query parameter %s would show a Redis credential in the ConfigMap, the pods' environment and the install notes: leave it out and set redis.auth (the password in existingSecret, an ACL user in username)" $name) }}
{{- end }}
{{- end }}
{{- if and $r.tls.enabled (not (hasPrefix "rediss://" $r.external.url)) }}
{{- fail "redis.tls.enabled needs a rediss:// redis.external.url" }}
{{- end }}
{{- if and (hasPrefix "rediss://" $r.external.url) (not $r.tls.enabled) }}
{{- fail "redis.external.url is rediss://: set redis.tls.enabled=true" }}
{{- end }}
{{- if and $r.auth.enabled (not $r.auth.existingSecret) (not $r.auth.password) }}
{{- fail "redis.auth: set existingSecret (recommended) or password, or auth.enabled=false" }}
{{- end }}
{{- else }}
{{- if $r.tls.enabled }}
{{- fail "redis.tls is for an external Redis; the bundled one speaks plain TCP inside the cluster" }}
{{- end }}
{{- if not $r.auth.enabled }}
{{- fail "the bundled Redis always requires a password: keep redis.auth.enabled=true" }}
{{- end }}
{{- if $r.auth.username }}
{{- fail "redis.auth.username is an ACL user of an external Redis; the bundled Redis has only the default user, so AUTH with that name would fail: leave username empty" }}
{{- end }}
{{- end }}
{{- $sa := $r.sentinelAuth }}
{{- if and $sa.username (not $sa.existingSecret) }}
{{- fail "redis.sentinelAuth.username needs redis.sentinelAuth.existingSecret: the Sentinels' AUTH takes a user name with its password" }}
{{- end }}
{{- if $sa.existingSecret }}
{{- if ne $r.mode "external" }}
{{- fail "redis.sentinelAuth is for the Sentinels of an external Redis; the bundled Redis has none" }}
{{- end }}
{{- if not (default (dict) (default (dict) .Values.config).redis).sentinel_master }}
{{- fail "redis.sentinelAuth.existingSecret needs config.redis.sentinel_master (and config.redis.sentinels): without Sentinels the password would go unused" }}
{{- end }}
{{- end }}
{{- if and .Values.tenants.existingSecret .Values.tenants.items }}
{{- fail "tenants: use either tenants.items or tenants.existingSecret, not both" }}
{{- end }}
{{- /* The services refuse these at start (admission/config.py); refused here, a mistake shows
       at install instead of as pods in CrashLoopBackOff. */}}
{{- $cfg := default (dict) .Values.config }}
{{- $call := int (default 20 (default (dict) $cfg.scheduler).release_call_ms) }}
{{- $socket := int (default 500 (default (dict) $cfg.redis).socket_timeout_ms) }}
{{- if ge $call $socket }}
{{- fail (printf "config.scheduler.release_call_ms (%d) must be below config.redis.socket_timeout_ms (%d): a release call the Redis client gives up on keeps running in Redis" $call $socket) }}
{{- end }}
{{- $sched := default (dict) $cfg.scheduler }}
{{- /* `default` would read a 0 (off) as unset: hasKey tells them apart. */}}
{{- $stuck := 30000 }}
{{- if hasKey $sched "stuck_after_ms" }}{{- $stuck = int $sched.stuck_after_ms }}{{- end }}
{{- $held := add (int (default 10000 (default (dict) $cfg.gateway).lease_ttl_ms)) (int (default 1000 $sched.reap_interval_ms)) }}
{{- if and (ne $stuck 0) (le $stuck $held) }}
{{- fail (printf "config.scheduler.stuck_after_ms (%d) must be above config.gateway.lease_ttl_ms + config.scheduler.reap_interval_ms (%d), or 0: a dead gateway's tasks stay in the running index that long and would make a healthy idle node look stuck" $stuck $held) }}
{{- end }}
{{- if and (eq $r.mode "external") (contains "?" $r.external.url) }}
{{- range (splitList "&" (regexReplaceAll "^[^?]*\\?" $r.external.url "")) }}
{{- $name := (splitList "=" .) | first }}
{{- /* An empty query (`/0?`) or parameter (`?&db=1`) is nothing to the services' parser. */}}
{{- if and . (not (has $name (list "db" "ssl_cert_reqs" "ssl_check_hostname" "ssl_ca_certs" "ssl_certfile" "ssl_keyfile"))) }}
{{- fail (printf "redis.external.url: its query parameter %s is not supported: a Redis URL may carry db and, on rediss://, ssl_cert_reqs, ssl_check_hostname, ssl_ca_certs, ssl_certfile, ssl_keyfile; the user name and password are redis.auth settings, timeouts and the connection pool config.redis settings" $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $i, $pool := (default (list) $cfg.pools) }}
{{- range $j, $backend := (default (list) $pool.backends) }}
{{- $url := "" }}
{{- if kindIs "string" $backend }}
{{- $url = $backend }}
{{- else if kindIs "map" $backend }}
{{- $url = toString (default "" $backend.url) }}
{{- end }}
{{- if regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@" $url }}
{{- fail (printf "config.pools[%d].backends[%d]: a user name or password in a backend's URL would show in the ConfigMap: leave it out; nodes started with vLLM's --api-key get the key from the variable the pool's backend_api_key_env names (set with gateway.extraEnv from a Secret)" $i $j) }}
{{- end }}
{{- end }}
{{- end }}
{{- $a := .Values.gateway.autoscaling }}
{{- if $a.enabled }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "gateway.autoscaling: minReplicas (%d) is above maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- /* Utilization is a share of the request: without one the HPA never scales. */}}
{{- $requests := default (dict) .Values.gateway.resources.requests }}
{{- if not $requests.cpu }}
{{- fail "gateway.autoscaling scales on CPU utilization: set gateway.resources.requests.cpu" }}
{{- end }}
{{- if and $a.targetMemoryUtilizationPercentage (not $requests.memory) }}
{{- fail "gateway.autoscaling.targetMemoryUtilizationPercentage: set gateway.resources.requests.memory" }}
{{- end }}
{{- end }}
{{- range $component := list "gateway" "scheduler" }}
{{- include "kvgate.validatePdb" (dict "root" $ "component" $component) }}
{{- end }}
{{- $sm := .Values.serviceMonitor }}
{{- if $sm.enabled }}
{{- /* Prometheus refuses a scrape timeout above the interval; the Prometheus Operator skips
       such a ServiceMonitor (an event and a log line), and nothing is scraped. */}}
{{- if gt (int64 (include "kvgate.durationMs" $sm.scrapeTimeout)) (int64 (include "kvgate.durationMs" $sm.interval)) }}
{{- fail (printf "serviceMonitor.scrapeTimeout (%s) is longer than serviceMonitor.interval (%s): the Prometheus Operator rejects such a ServiceMonitor and nothing is scraped; set scrapeTimeout to at most the interval" $sm.scrapeTimeout $sm.interval) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Milliseconds in a duration of one unit, as the schema allows them: 500ms, 15s, 1m, 1h. */}}
{{- define "kvgate.durationMs" -}}
{{- $digits := regexReplaceAll "^0+([0-9])" (regexFind "^[0-9]+" .) "${1}" }}
{{- $unit := regexReplaceAll "^[0-9]+" . "" }}
{{- mul (int64 $digits) (get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit) }}
{{- end }}

{{/*
A PodDisruptionBudget needs exactly one of its two fields, and one that allows no eviction at
all (minAvailable up to the replica count, maxUnavailable 0) makes every node drain hang.
Kubernetes rounds a percentage of the pods up, for minAvailable as for maxUnavailable: a
minAvailable of "50%" keeps 1 of 1 replica, "60%" 2 of 2.
*/}}
{{- define "kvgate.validatePdb" -}}
{{- $v := index .root.Values .component }}
{{- $pdb := $v.podDisruptionBudget }}
{{- $where := printf "%s.podDisruptionBudget" .component }}
{{- if $pdb.enabled }}
{{- $min := $pdb.minAvailable }}
{{- $max := $pdb.maxUnavailable }}
{{- if eq (kindIs "invalid" $min) (kindIs "invalid" $max) }}
{{- fail (printf "%s: set exactly one of maxUnavailable and minAvailable (the other to null)" $where) }}
{{- end }}
{{- $count := int $v.replicas }}
{{- $counted := "replicas" }}
{{- if and (eq .component "gateway") $v.autoscaling.enabled }}
{{- $count = int $v.autoscaling.minReplicas }}
{{- $counted = "autoscaling.minReplicas" }}
{{- end }}
{{- $noEviction := false }}
{{- if not (kindIs "invalid" $min) }}
{{- if kindIs "string" $min }}
{{- $kept := div (add (mul (int (trimSuffix "%" $min)) $count) 99) 100 }}
{{- $noEviction = ge $kept $count }}
{{- else }}
{{- $noEviction = ge (int $min) $count }}
{{- end }}
{{- else }}
{{- $noEviction = eq (int (trimSuffix "%" (toString $max))) 0 }}
{{- end }}
{{- if $noEviction }}
{{- fail (printf "%s allows no pod to be evicted with %s.%s=%d, so node drains would never finish: lower minAvailable or raise maxUnavailable" $where .component $counted $count) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Redis URL without credentials: what the ConfigMap may show. */}}
{{- define "kvgate.redis.url" -}}
{{- if eq .Values.redis.mode "external" }}
{{- .Values.redis.external.url }}
{{- else }}
{{- printf "redis://%s:%d/0" (include "kvgate.redis.host" .) (int .Values.redis.bundled.port) }}
{{- end }}
{{- end }}

{{- define "kvgate.redis.secretName" -}}
{{- default (printf "%s-redis-auth" (include "kvgate.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "kvgate.redis.secretKey" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecretPasswordKey }}
{{- else -}}
redis-password
{{- end }}
{{- end }}

{{/*
REDIS_URL with the password, assembled by the kubelet from REDIS_PASSWORD ($(VAR) expansion)
so that the password only ever lives in a Secret. It is inserted as is, not URL-encoded: use
a password of URL-safe characters (A-Z a-z 0-9 . _ ~ -), as the chart's generated one is.
*/}}
{{- define "kvgate.redis.env" -}}
{{- $url := include "kvgate.redis.url" . }}
{{- if .Values.redis.auth.enabled }}
{{- $scheme := regexFind "^rediss?://" $url }}
{{- $user := .Values.redis.auth.username }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvgate.redis.secretName" . }}
      key: {{ include "kvgate.redis.secretKey" . }}
- name: REDIS_URL
  value: {{ printf "%s%s:$(REDIS_PASSWORD)@%s" $scheme $user (trimPrefix $scheme $url) | quote }}
{{- else }}
- name: REDIS_URL
  value: {{ $url | quote }}
{{- end }}
{{- with .Values.redis.sentinelAuth }}
{{- if .existingSecret }}
- name: {{ include "kvgate.redis.sentinelPasswordEnv" $ }}
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .existingSecretPasswordKey }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The variable holding the Sentinels' password (redis.sentinelAuth), named in the config's
redis.sentinel_password_env: the services read it from there at start.
*/}}
{{- define "kvgate.redis.sentinelPasswordEnv" -}}
KVGATE_SENTINEL_PASSWORD
{{- end }}

{{- define "kvgate.redis.caPath" -}}
/etc/kvgate/redis-ca/ca.crt
{{- end }}

{{- define "kvgate.backend.caPath" -}}
/etc/kvgate/backend-ca/ca.crt
{{- end }}

{{/* ---------------------------------------------------------------- config */}}

{{/*
The [redis], [gateway], [scheduler], [tiers] and [[pools]] tables, from .Values.config, plus
the keys the chart owns: where Redis is (never its password), the CA path, and the listen
address and ports the probes and Services use. Tenants are not here: see tenants.toml.
*/}}
{{- define "kvgate.config.toml" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $redis := default (dict) $cfg.redis }}
{{- $_ := set $redis "url" (include "kvgate.redis.url" .) }}
{{- if and .Values.redis.tls.enabled .Values.redis.tls.caSecret }}
{{- $_ := set $redis "ssl_ca_file" (include "kvgate.redis.caPath" .) }}
{{- end }}
{{- if .Values.redis.sentinelAuth.existingSecret }}
{{- $_ := set $redis "sentinel_password_env" (include "kvgate.redis.sentinelPasswordEnv" .) }}
{{- with .Values.redis.sentinelAuth.username }}
{{- $_ := set $redis "sentinel_username" . }}
{{- end }}
{{- end }}
{{- $gateway := default (dict) $cfg.gateway }}
{{- $_ := set $gateway "host" .Values.listenAddress }}
{{- $_ := set $gateway "port" (int .Values.gateway.port) }}
{{- $scheduler := default (dict) $cfg.scheduler }}
{{- $_ := set $scheduler "host" .Values.listenAddress }}
{{- $_ := set $scheduler "port" (int .Values.scheduler.port) }}
{{- if .Values.backendTls.caSecret }}
{{- range $pool := (default (list) $cfg.pools) }}
{{- $_ := set $pool "backend_ca_file" (include "kvgate.backend.caPath" $) }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "redis" $redis }}
{{- $_ := set $cfg "gateway" $gateway }}
{{- $_ := set $cfg "scheduler" $scheduler -}}
# kvgate configuration rendered by the Helm chart {{ include "kvgate.chart" . }}.
# REDIS_URL (from a Secret) overrides redis.url; tenants live in a Secret (tenants.toml).
{{ include "kvgate.toml.table" (dict "path" "" "map" $cfg "where" "config") | trim }}
{{- end }}

{{/* [[tenants]] tables only, so that the file can be appended to config.toml. */}}
{{- define "kvgate.tenants.toml" -}}
# kvgate tenants: API keys as SHA-256 hex only.
{{- if .Values.tenants.items }}
{{- /* One [[tenants]] table per item, each named in messages as its values (tenants.items[i]). */}}
{{- $tables := "" }}
{{- range $i, $tenant := .Values.tenants.items }}
{{- $tables = printf "%s\n\n[[tenants]]%s" $tables (include "kvgate.toml.table" (dict "path" "tenants" "map" $tenant "where" (printf "tenants.items[%d]" $i))) }}
{{- end }}
{{ $tables | trim }}
{{- end }}
{{- end }}

{{- define "kvgate.tenants.secretName" -}}
{{- default (printf "%s-tenants" (include "kvgate.fullname" .)) .Values.tenants.existingSecret }}
{{- end }}

{{- define "kvgate.tenants.secretKey" -}}
{{- if .Values.tenants.existingSecret }}
{{- .Values.tenants.existingSecretKey }}
{{- else -}}
tenants.toml
{{- end }}
{{- end }}

{{/* Paths inside the pods. */}}
{{- define "kvgate.paths.config" -}}/etc/kvgate/config/config.toml{{- end }}
{{- define "kvgate.paths.tenants" -}}/etc/kvgate/tenants/tenants.toml{{- end }}
{{- define "kvgate.paths.merged" -}}/run/kvgate/kvgate.toml{{- end }}

{{/* Volumes and mounts every kvgate container has: /tmp, and the Redis CA if any. */}}
{{- define "kvgate.commonVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- if and .Values.redis.tls.enabled .Values.redis.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.tls.caSecret }}
    defaultMode: 0444
    items:
      - key: {{ .Values.redis.tls.caSecretKey }}
        path: ca.crt
{{- end }}
{{- if .Values.backendTls.caSecret }}
- name: backend-ca
  secret:
    secretName: {{ .Values.backendTls.caSecret }}
    defaultMode: 0444
    items:
      - key: {{ .Values.backendTls.caSecretKey }}
        path: ca.crt
{{- end }}
{{- end }}

{{- define "kvgate.commonMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if and .Values.redis.tls.enabled .Values.redis.tls.caSecret }}
- name: redis-ca
  mountPath: /etc/kvgate/redis-ca
  readOnly: true
{{- end }}
{{- if .Values.backendTls.caSecret }}
- name: backend-ca
  mountPath: /etc/kvgate/backend-ca
  readOnly: true
{{- end }}
{{- end }}

{{/*
Seconds a gateway takes, at most, to exit after its --shutdown-timeout: cancelled streams end,
pending settles drain, connections close (SETTLE_MARGIN_S in gateway/shutdown.py; a chart test
checks that they agree). The pod's grace period is preStop sleep + shutdown timeout + this.
*/}}
{{- define "kvgate.gatewaySettleMarginSeconds" -}}
5
{{- end }}

{{/*
The gateway's readiness path. /readyz answers 503 while Redis is unreachable; with
config.gateway.fail_open_tiers set, the gateways must keep receiving traffic then, so
readiness follows /healthz (the process serves) instead.
*/}}
{{- define "kvgate.gateway.readinessPath" -}}
{{- if (default (dict) .Values.config.gateway).fail_open_tiers -}}
/healthz
{{- else -}}
/readyz
{{- end }}
{{- end }}

{{/* preStop: let endpoint removal reach every load balancer before the server stops. */}}
{{- define "kvgate.preStop" -}}
{{- if gt (int .seconds) 0 }}
lifecycle:
  preStop:
{{- if semverCompare ">=1.30-0" .root.Capabilities.KubeVersion.Version }}
    sleep:
      seconds: {{ int .seconds }}
{{- else }}
    exec:
      command: ["sleep", "{{ int .seconds }}"]
{{- end }}
{{- end }}
{{- end }}

{{/*
A TOML emitter for the values under `config:` and `tenants.items`.

Helm's own toToml cannot be used: Helm reads every number in values as a float64, so
toToml writes `port = 8000.0` and `burst = 1e+09`, which admission.config rejects
("expected an integer"). Here an integral number is written as an integer, any other as a
float, strings as JSON-escaped basic strings (a valid TOML subset), and null values are left
out so the service's default applies.

Layout: a table's scalars and inline arrays first, then its sub-tables, then its arrays of
tables ([[pools]]), recursively, keys sorted. A table with nothing but sub-tables gets no
header of its own (TOML implies it), an empty one none at all. Arrays of tables nested in an
array of tables ([[pools.backends]]) attach to its latest element, as TOML specifies.
*/}}

{{- define "kvgate.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/* "true" when the value is a non-empty list of tables only. */}}
{{- define "kvgate.toml.isTableArray" -}}
{{- if and (kindIs "slice" .) (gt (len .) 0) }}
{{- $all := true }}
{{- range . }}{{ if not (kindIs "map" .) }}{{ $all = false }}{{ end }}{{ end }}
{{- if $all }}true{{ end }}
{{- end }}
{{- end }}

{{/* "true" when a table has a key = value line of its own (else its header is implied). */}}
{{- define "kvgate.toml.hasScalars" -}}
{{- range $k, $v := . }}
{{- if not (or (kindIs "invalid" $v) (kindIs "map" $v) (include "kvgate.toml.isTableArray" $v)) }}true{{ end }}
{{- end }}
{{- end }}

{{/*
Call with (dict "v" $value "where" "config.gateway.port"): `where` is the value's place in
values.yaml, for the message that refuses it.

An integral number above 2^53 - 1 is refused: Helm holds every number of values.yaml as a
float64, which above that no longer holds each integer (2^53 + 1 reads as 2^53), and past
2^63 int64 wraps it (1e20 would be written as -9223372036854775808). The services refuse any
integer above 2^53 - 1 anyway (docs/configuration.md), so nothing valid is lost.
*/}}
{{- define "kvgate.toml.value" -}}
{{- $v := .v }}
{{- $where := .where }}
{{- if kindIs "string" $v }}{{ toJson $v }}
{{- else if kindIs "bool" $v }}{{ $v }}
{{- else if or (kindIs "float64" $v) (kindIs "float32" $v) }}
{{- if eq (floor $v) (float64 $v) }}
{{- if or (gt (float64 $v) 9007199254740991.0) (lt (float64 $v) -9007199254740991.0) }}
{{- fail (printf "%s: %.0f is beyond 2^53 - 1 (9007199254740991): every number of values.yaml is a float64, which holds no larger integer exactly, and the services accept none larger" $where $v) }}
{{- end }}
{{- printf "%d" (int64 $v) }}{{ else }}{{ $v }}{{ end }}
{{- else if or (kindIs "int" $v) (kindIs "int64" $v) (kindIs "int32" $v) (kindIs "uint64" $v) }}
{{- if or (gt $v 9007199254740991) (lt $v -9007199254740991) }}
{{- fail (printf "%s: %v is beyond 2^53 - 1 (9007199254740991), the largest integer the services accept" $where $v) }}
{{- end }}{{ $v }}
{{- else if kindIs "slice" $v }}[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "kvgate.toml.value" (dict "v" $e "where" (printf "%s[%d]" $where $i)) }}{{ end }}]
{{- else if kindIs "map" $v }}{ {{- range $i, $k := keys $v | sortAlpha }}{{ if $i }},{{ end }} {{ include "kvgate.toml.key" $k }} = {{ include "kvgate.toml.value" (dict "v" (get $v $k) "where" (printf "%s.%s" $where $k)) }}{{ end }} }
{{- else }}{{ fail (printf "%s: cannot write %v (%s) as TOML" $where $v (kindOf $v)) }}
{{- end }}
{{- end }}

{{/*
Call with (dict "path" "pools" "map" $table "where" "config.pools[0]"); path "" is the
document root. `where` is the table's place in values.yaml, for messages.
*/}}
{{- define "kvgate.toml.table" -}}
{{- $path := .path }}
{{- $m := .map }}
{{- $where := .where }}
{{- $names := keys $m | sortAlpha }}
{{- range $k := $names }}
{{- $v := get $m $k }}
{{- if not (or (kindIs "invalid" $v) (kindIs "map" $v) (include "kvgate.toml.isTableArray" $v)) }}
{{ include "kvgate.toml.key" $k }} = {{ include "kvgate.toml.value" (dict "v" $v "where" (printf "%s.%s" $where $k)) }}
{{- end }}
{{- end }}
{{- range $k := $names }}
{{- $v := get $m $k }}
{{- $sub := include "kvgate.toml.key" $k }}
{{- if $path }}{{ $sub = printf "%s.%s" $path $sub }}{{ end }}
{{- if kindIs "map" $v }}
{{- if include "kvgate.toml.hasScalars" $v }}

[{{ $sub }}]
{{- end }}
{{- include "kvgate.toml.table" (dict "path" $sub "map" $v "where" (printf "%s.%s" $where $k)) }}
{{- end }}
{{- end }}
{{- range $k := $names }}
{{- $v := get $m $k }}
{{- $sub := include "kvgate.toml.key" $k }}
{{- if $path }}{{ $sub = printf "%s.%s" $path $sub }}{{ end }}
{{- if include "kvgate.toml.isTableArray" $v }}
{{- range $i, $e := $v }}

[[{{ $sub }}]]
{{- include "kvgate.toml.table" (dict "path" $sub "map" $e "where" (printf "%s.%s[%d]" $where $k $i)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

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

{{- define "kvgate.toml.value" -}}
{{- $v := . }}
{{- if kindIs "string" $v }}{{ toJson $v }}
{{- else if kindIs "bool" $v }}{{ $v }}
{{- else if or (kindIs "float64" $v) (kindIs "float32" $v) }}
{{- if eq (floor $v) (float64 $v) }}{{ printf "%d" (int64 $v) }}{{ else }}{{ $v }}{{ end }}
{{- else if or (kindIs "int" $v) (kindIs "int64" $v) (kindIs "int32" $v) (kindIs "uint64" $v) }}{{ $v }}
{{- else if kindIs "slice" $v }}[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "kvgate.toml.value" $e }}{{ end }}]
{{- else if kindIs "map" $v }}{ {{- range $i, $k := keys $v | sortAlpha }}{{ if $i }},{{ end }} {{ include "kvgate.toml.key" $k }} = {{ include "kvgate.toml.value" (get $v $k) }}{{ end }} }
{{- else }}{{ fail (printf "config: cannot write %v (%s) as TOML" $v (kindOf $v)) }}
{{- end }}
{{- end }}

{{/* Call with (dict "path" "pools" "map" $table); path "" is the document root. */}}
{{- define "kvgate.toml.table" -}}
{{- $path := .path }}
{{- $m := .map }}
{{- $names := keys $m | sortAlpha }}
{{- range $k := $names }}
{{- $v := get $m $k }}
{{- if not (or (kindIs "invalid" $v) (kindIs "map" $v) (include "kvgate.toml.isTableArray" $v)) }}
{{ include "kvgate.toml.key" $k }} = {{ include "kvgate.toml.value" $v }}
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
{{- include "kvgate.toml.table" (dict "path" $sub "map" $v) }}
{{- end }}
{{- end }}
{{- range $k := $names }}
{{- $v := get $m $k }}
{{- $sub := include "kvgate.toml.key" $k }}
{{- if $path }}{{ $sub = printf "%s.%s" $path $sub }}{{ end }}
{{- if include "kvgate.toml.isTableArray" $v }}
{{- range $e := $v }}

[[{{ $sub }}]]
{{- include "kvgate.toml.table" (dict "path" $sub "map" $e) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Resource names are <release>-<component> (router, prefill, decode, serve,
etcd): short, and the etcd Service name is what the roles dial.
*/}}
{{- define "tandem.name" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "tandem.clusterName" -}}
{{- .Values.clusterName | default .Release.Name -}}
{{- end -}}

{{/*
The Secret of etcd's client-certificate authentication (etcd.auth): the one
named, or for the in-chart etcd the one the chart generates; empty when etcd
runs without it.
*/}}
{{- define "tandem.etcdAuthSecret" -}}
{{- $a := .Values.etcd.auth -}}
{{- if $a.enabled -}}
{{- if $a.secretName -}}
{{- $a.secretName -}}
{{- else if .Values.etcd.enabled -}}
{{- include "tandem.name" (dict "root" . "component" "etcd-auth") -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The etcd client URLs the roles get in TANDEM_ETCD. */}}
{{- define "tandem.etcdUrls" -}}
{{- if .Values.etcd.enabled -}}
{{- $scheme := ternary "https" "http" .Values.etcd.auth.enabled -}}
{{- printf "%s://%s:2379" $scheme (include "tandem.name" (dict "root" . "component" "etcd")) -}}
{{- else -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{/*
Fails the render when a role's termination grace period does not cover its
preStop sleep plus the binary's drain (`drain` seconds): the kubelet would
SIGKILL requests still in flight.
*/}}
{{- define "tandem.checkGrace" -}}
{{- $need := add (int .values.preStopSleepSeconds) (int .drain) -}}
{{- if le (int .values.terminationGracePeriodSeconds) $need -}}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds + the binary's %d s drain (%d)" .component (int .values.terminationGracePeriodSeconds) (int .drain) $need) -}}
{{- end -}}
{{- end -}}

{{/*
nvidia.com/gpu for `--devices gpu:...`: one per listed id, `tp` for gpu:all;
empty otherwise.
*/}}
{{- define "tandem.gpuCount" -}}
{{- $d := .devices | default "" | toString | trim -}}
{{- if hasPrefix "gpu:" $d -}}
{{- $ids := trimPrefix "gpu:" $d | trim -}}
{{- if eq $ids "all" -}}{{ int .tp }}{{- else -}}{{ len (splitList "," $ids) }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* The role's resources, with nvidia.com/gpu added for GPU devices unless set. */}}
{{- define "tandem.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- $gpus := include "tandem.gpuCount" . -}}
{{- if $gpus -}}
{{- $limits := get $res "limits" | default dict -}}
{{- if not (hasKey $limits "nvidia.com/gpu") -}}
{{- $_ := set $limits "nvidia.com/gpu" (int $gpus) -}}
{{- end -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Engine flags shared by serve, prefill and decode (tp, devices, threads). */}}
{{- define "tandem.engineArgs" -}}
{{- $v := .values -}}
{{- if lt (int $v.tp) 1 -}}
{{- fail (printf "%s.tp must be at least 1" .component) -}}
{{- end -}}
{{- $d := $v.devices | default "" | toString | trim -}}
{{- if and (hasPrefix "cpu:" $d) (gt (int $v.tp) 1) (ne (trimPrefix "cpu:" $d) (toString (int $v.tp))) -}}
{{- fail (printf "%s: devices %s and tp %d disagree" .component $d (int $v.tp)) -}}
{{- end -}}
- --tp
- {{ int $v.tp | quote }}
{{- with $d }}
- --devices
- {{ . | quote }}
{{- end }}
{{- if $v.threads }}
- --threads
- {{ int $v.threads | quote }}
{{- end }}
{{- end -}}

{{/* Flags every model-loading role shares with the router (fingerprint, length). */}}
{{- define "tandem.modelArgs" -}}
- --kv-cache-page-size
- {{ int .Values.kvCachePageSize | quote }}
{{- if .Values.maxLength }}
- --max-length
- {{ int .Values.maxLength | quote }}
{{- end }}
{{- end -}}

{{/* Env of every tandem container: model, cache, telemetry, logging. */}}
{{- define "tandem.commonEnv" -}}
- name: TANDEM_MODEL
  value: {{ .Values.model.name | quote }}
- name: TANDEM_CACHE
  value: {{ .Values.model.cacheDir | quote }}
{{- with .Values.otlp.endpoint }}
- name: TANDEM_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .Values.logLevel }}
- name: TANDEM_LOG
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Env of the roles that use etcd (router, prefill, decode): where it
     is, and the client certificate it demands (etcd.auth). */}}
{{- define "tandem.etcdEnv" -}}
- name: TANDEM_ETCD
  value: {{ include "tandem.etcdUrls" . | quote }}
- name: TANDEM_CLUSTER
  value: {{ include "tandem.clusterName" . | quote }}
{{- if include "tandem.etcdAuthSecret" . }}
- name: TANDEM_ETCD_CA
  value: /etc/tandem/etcd-tls/ca.crt
- name: TANDEM_ETCD_CERT
  value: /etc/tandem/etcd-tls/client.crt
- name: TANDEM_ETCD_KEY
  value: /etc/tandem/etcd-tls/client.key
{{- end }}
{{- end -}}

{{/* Env, mounts and volumes of the TLS material and API keys a role uses:
     cluster TLS for the roles on the internal gRPC (router, nodes), HTTPS
     and API keys for the front (router, serve). Context: root, cluster, front. */}}
{{- define "tandem.securityEnv" -}}
{{- $t := .root.Values.tls -}}
{{- if and .cluster $t.cluster.secretName }}
- name: TANDEM_CLUSTER_CA
  value: /etc/tandem/cluster-tls/ca.crt
- name: TANDEM_CLUSTER_CERT
  value: /etc/tandem/cluster-tls/tls.crt
- name: TANDEM_CLUSTER_KEY
  value: /etc/tandem/cluster-tls/tls.key
- name: TANDEM_CLUSTER_SERVER_NAME
  value: {{ $t.cluster.serverName | quote }}
{{- end }}
{{- if and .front $t.http.secretName }}
- name: TANDEM_TLS_CERT
  value: /etc/tandem/http-tls/tls.crt
- name: TANDEM_TLS_KEY
  value: /etc/tandem/http-tls/tls.key
{{- end }}
{{- if and .front .root.Values.apiKeys.secretName }}
- name: TANDEM_API_KEY_FILE
  value: /etc/tandem/api-keys/keys
{{- end }}
{{- end -}}

{{- define "tandem.securityMounts" -}}
{{- $t := .root.Values.tls -}}
{{- if and .etcd (include "tandem.etcdAuthSecret" .root) }}
- name: etcd-tls
  mountPath: /etc/tandem/etcd-tls
  readOnly: true
{{- end }}
{{- if and .cluster $t.cluster.secretName }}
- name: cluster-tls
  mountPath: /etc/tandem/cluster-tls
  readOnly: true
{{- end }}
{{- if and .front $t.http.secretName }}
- name: http-tls
  mountPath: /etc/tandem/http-tls
  readOnly: true
{{- end }}
{{- if and .front .root.Values.apiKeys.secretName }}
- name: api-keys
  mountPath: /etc/tandem/api-keys
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.securityVolumes" -}}
{{- $t := .root.Values.tls -}}
{{- with and .etcd (include "tandem.etcdAuthSecret" .root) }}
# The client side only: etcd's own key stays in the etcd pod.
- name: etcd-tls
  secret:
    secretName: {{ . }}
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: client.crt, path: client.crt}
      - {key: client.key, path: client.key}
{{- end }}
{{- if and .cluster $t.cluster.secretName }}
- name: cluster-tls
  secret:
    secretName: {{ $t.cluster.secretName }}
{{- end }}
{{- if and .front $t.http.secretName }}
- name: http-tls
  secret:
    secretName: {{ $t.http.secretName }}
{{- end }}
{{- if and .front .root.Values.apiKeys.secretName }}
- name: api-keys
  secret:
    secretName: {{ .root.Values.apiKeys.secretName }}
{{- end }}
{{- end -}}

{{/* Volume mounts of every tandem container. */}}
{{- define "tandem.volumeMounts" -}}
{{- if ne .Values.model.cache.type "image" }}
- name: model-cache
  mountPath: {{ .Values.model.cacheDir }}
{{- end }}
# pip's temporary files while fetching a model (the root filesystem is read-only).
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "tandem.volumes" -}}
{{- $c := .Values.model.cache -}}
{{- if eq $c.type "emptyDir" }}
- name: model-cache
  emptyDir:
    {{- with $c.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- else if eq $c.type "persistentVolumeClaim" }}
{{- if not $c.claimName }}
{{- fail "model.cache.claimName is required when model.cache.type is persistentVolumeClaim" }}
{{- end }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ $c.claimName }}
{{- else if ne $c.type "image" }}
{{- fail (printf "model.cache.type must be emptyDir, persistentVolumeClaim or image, not %q" $c.type) }}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- end -}}

{{/* A probe: the role's timing values plus a fixed HTTP endpoint. */}}
{{- define "tandem.probe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
  {{- with .scheme }}
  scheme: {{ . }}
  {{- end }}
{{ toYaml .timing }}
{{- end -}}

{{/* Scheduling settings and pull secrets of a pod, shared by every role. */}}
{{- define "tandem.podScheduling" -}}
{{- $v := .values -}}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* preStop: the native sleep action (no shell needed in the image). */}}
{{- define "tandem.lifecycle" -}}
{{- if gt (int .preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ int .preStopSleepSeconds }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget for one role. */}}
{{- define "tandem.pdb" -}}
{{- $pdb := .values.podDisruptionBudget -}}
{{- if $pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.name" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  {{- if hasKey $pdb "minAvailable" }}
  minAvailable: {{ $pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/*
The Deployment of a tandem role. Arguments: root, component, values (the
role's values), args (the container args, subcommand first), ports (list of
name/port), probes (startup/readiness/liveness -> path), probePort,
etcd (bool: the role uses etcd), node (bool: prefill/decode env).
*/}}
{{- define "tandem.deployment" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $front := not .node -}}
{{- $sec := dict "root" $root "cluster" .etcd "etcd" .etcd "front" $front -}}
{{- $scheme := ternary "HTTPS" "" (and $front (ne $root.Values.tls.http.secretName "")) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.name" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  replicas: {{ int $v.replicas }}
  {{- with $v.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.labels" . | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      # The binary never talks to the Kubernetes API.
      automountServiceAccountToken: false
      # Service links would inject <SERVICE>_PORT variables: a Service named
      # `tandem` would set TANDEM_PORT=tcp://..., which the binary reads as
      # its --port.
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ int $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with (include "tandem.podScheduling" . | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tandem"]
          args:
            {{- .args | nindent 12 }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            {{- if .node }}
            # Dialled by routers and peers through etcd: the pod's own address.
            - name: TANDEM_ADVERTISE_HOST
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: TANDEM_WORKER_ID
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            {{- with $root.Values.ucxTls }}
            - name: TANDEM_UCX_TLS
              value: {{ . | quote }}
            {{- end }}
            {{- end }}
            {{- if include "tandem.gpuCount" $v }}
            # The GPU path reaches NVIDIA GPUs through their Vulkan driver,
            # which NVIDIA's container runtime mounts only with `graphics`.
            - name: NVIDIA_DRIVER_CAPABILITIES
              value: compute,utility,graphics
            {{- end }}
            {{- include "tandem.commonEnv" $root | nindent 12 }}
            {{- if .etcd }}
            {{- include "tandem.etcdEnv" $root | nindent 12 }}
            {{- end }}
            {{- include "tandem.securityEnv" $sec | nindent 12 }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- range .ports }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
          startupProbe:
            {{- include "tandem.probe" (dict "path" .probes.startup "port" .probePort "scheme" $scheme "timing" $v.probes.startup) | nindent 12 }}
          readinessProbe:
            {{- include "tandem.probe" (dict "path" .probes.readiness "port" .probePort "scheme" $scheme "timing" $v.probes.readiness) | nindent 12 }}
          livenessProbe:
            {{- include "tandem.probe" (dict "path" .probes.liveness "port" .probePort "scheme" $scheme "timing" $v.probes.liveness) | nindent 12 }}
          {{- with (include "tandem.lifecycle" $v | trim) }}
          {{- . | nindent 10 }}
          {{- end }}
          resources:
            {{- include "tandem.resources" $v | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "tandem.volumeMounts" $root | trim | nindent 12 }}
            {{- include "tandem.securityMounts" $sec | nindent 12 }}
      volumes:
        {{- include "tandem.volumes" $root | trim | nindent 8 }}
        {{- include "tandem.securityVolumes" $sec | nindent 8 }}
{{- end -}}

{{/* The LoadBalancer (by default) Service in front of the router or serve pods. */}}
{{- define "tandem.frontService" -}}
{{- $s := .values.service -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "tandem.name" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
  {{- with $s.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $s.type }}
  {{- if eq $s.type "LoadBalancer" }}
  {{- with $s.loadBalancerSourceRanges }}
  loadBalancerSourceRanges:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $s.loadBalancerClass }}
  loadBalancerClass: {{ . }}
  {{- end }}
  {{- end }}
  {{- if and (has $s.type (list "LoadBalancer" "NodePort")) $s.externalTrafficPolicy }}
  externalTrafficPolicy: {{ $s.externalTrafficPolicy }}
  {{- end }}
  selector:
    {{- include "tandem.selectorLabels" . | nindent 4 }}
  ports:
    - name: http
      port: {{ int $s.port }}
      targetPort: http
      protocol: TCP
{{- end -}}

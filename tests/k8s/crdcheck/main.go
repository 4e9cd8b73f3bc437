// crdcheck strictly decodes the Prometheus Operator objects of rendered manifests into the
// operator's own Go API types (github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring),
// so an unknown or misspelt field, or a value of the wrong type, is an error. The core
// Kubernetes kinds are checked against their JSON schemas by tests/test_helm_chart.py.
//
// Usage: crdcheck FILE.yaml... ; prints one line per object checked, exits 1 on any error.
package main

import (
	"bytes"
	"fmt"
	"os"
	"regexp"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"sigs.k8s.io/yaml"
)

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

func check(doc []byte) (string, error) {
	var meta struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := yaml.Unmarshal(doc, &meta); err != nil {
		return "", err
	}
	id := fmt.Sprintf("%s %s/%s", meta.APIVersion, meta.Kind, meta.Metadata.Name)
	if meta.APIVersion != "monitoring.coreos.com/v1" {
		return "", nil
	}
	var obj any
	switch meta.Kind {
	case "ServiceMonitor":
		obj = &monitoringv1.ServiceMonitor{}
	case "PrometheusRule":
		obj = &monitoringv1.PrometheusRule{}
	case "PodMonitor":
		obj = &monitoringv1.PodMonitor{}
	default:
		return id, fmt.Errorf("no type for kind %q", meta.Kind)
	}
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return id, err
	}
	return id, nil
}

func main() {
	failed := false
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		for _, doc := range docSep.Split(string(data), -1) {
			if len(bytes.TrimSpace([]byte(doc))) == 0 {
				continue
			}
			id, err := check([]byte(doc))
			if err != nil {
				fmt.Printf("FAIL %s: %s: %v\n", path, id, err)
				failed = true
			} else if id != "" {
				fmt.Printf("ok %s\n", id)
			}
		}
	}
	if failed {
		os.Exit(1)
	}
}

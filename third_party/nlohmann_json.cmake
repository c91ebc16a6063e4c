# nlohmann_json 3 (header-only), optional: graph JSON (graph/graph_json.cpp) needs it and says so at run time
# when it was missing at build time. Sets nlohmann_json_FOUND and the target nlohmann_json::nlohmann_json.
find_package(nlohmann_json 3 QUIET)

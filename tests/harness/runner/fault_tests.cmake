# The fault CTests, listed from the fault table itself at test time (docs/design.md section 19).
#
# CTest includes this file (the directory's TEST_INCLUDE_FILES, through the generated
# fault_tests_include.cmake that sets the paths below) whenever it reads the test list, so the
# tests follow the table of the meshproof binary that runs them: a new FaultDescriptor row gets
# its fault, clean-run and claim tests without an edit here, and nothing reads the C++ source.
# This is how gtest_discover_tests lists test cases. A binary that cannot list its table (not
# built yet, or crashing) gives one failing test that says so, never an empty list.
#
# Set by the includer: MESHPROOF (the binary), RUN_CHECK (check_run.sh), RUNNER_DIR (this
# folder), SCENARIOS, GOLDEN, OUT (the runner's build folder), PYTHON ("" without Python),
# SH (the shell).

execute_process(COMMAND "${MESHPROOF}" faults --json RESULT_VARIABLE rc OUTPUT_VARIABLE table
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  add_test(runner.fault_table_listed "${SH}" -c
           "echo 'cannot list the fault table: ${MESHPROOF} faults --json: ${rc}'; exit 1")
  set_tests_properties(runner.fault_table_listed PROPERTIES LABELS cpu)
  return()
endif()
string(JSON rows ERROR_VARIABLE json_error LENGTH "${table}")
if(json_error OR rows EQUAL 0)
  add_test(runner.fault_table_listed "${SH}" -c
           "echo 'meshproof faults --json gave no rows: ${json_error}'; exit 1")
  set_tests_properties(runner.fault_table_listed PROPERTIES LABELS cpu)
  return()
endif()

set(claims "")
math(EXPR last "${rows} - 1")
foreach(i RANGE ${last})
  string(JSON fault GET "${table}" ${i} name)
  set(out_dir "${OUT}/out_fault_${fault}")
  # Each fault's library scenario (expect: caught) is caught by an intended check: exit 0 and a
  # failing check in report.json.
  add_test(runner.fault.${fault} "${SH}" "${RUN_CHECK}" 0 "${out_dir}" report.json
           "\"verdict\": \"fail\"" -- "${MESHPROOF}" run "${SCENARIOS}/faults/${fault}.yaml"
           --golden-dir "${GOLDEN}" --backend cpu --out "${out_dir}" --quiet)
  set_tests_properties(runner.fault.${fault} PROPERTIES LABELS cpu TIMEOUT 300)
  if(PYTHON)
    # Its negative control: the same scenario without faults passes every check.
    add_test(runner.fault_clean.${fault} "${PYTHON}" "${RUNNER_DIR}/check_clean_run.py"
             "${OUT}/out_clean_${fault}" -- "${MESHPROOF}" run "${SCENARIOS}/faults/${fault}.yaml"
             --golden-dir "${GOLDEN}" --backend cpu --set faults=[] --set expect=pass
             --out "${OUT}/out_clean_${fault}" --quiet)
    set_tests_properties(runner.fault_clean.${fault} PROPERTIES LABELS cpu TIMEOUT 300)
    # Each check the row claims catches the fault with that check alone enabled
    # (check_fault_claims.py holds the scenario of each pair).
    string(JSON n LENGTH "${table}" ${i} caught_by)
    if(n GREATER 0)
      math(EXPR n_last "${n} - 1")
      foreach(j RANGE ${n_last})
        string(JSON check GET "${table}" ${i} caught_by ${j})
        list(APPEND claims "${fault}:${check}")
        add_test(runner.fault_claim.${fault}.${check} "${PYTHON}"
                 "${RUNNER_DIR}/check_fault_claims.py" run "${MESHPROOF}" "${SCENARIOS}"
                 "${GOLDEN}" "${OUT}/out_claim_${fault}_${check}" ${fault} ${check})
        set_tests_properties(runner.fault_claim.${fault}.${check} PROPERTIES LABELS cpu
                             TIMEOUT 300)
      endforeach()
    endif()
    # With two or more claims: all of them enabled together, each catching the fault (issue
    # #46: the catalog and the checks must agree in one run too, not only one check at a time).
    if(n GREATER 1)
      add_test(runner.fault_claims_together.${fault} "${PYTHON}"
               "${RUNNER_DIR}/check_fault_claims.py" together "${MESHPROOF}" "${SCENARIOS}"
               "${GOLDEN}" "${OUT}/out_together_${fault}" ${fault})
      set_tests_properties(runner.fault_claims_together.${fault} PROPERTIES LABELS cpu
                           TIMEOUT 300)
    endif()
  endif()
endforeach()

# The report-format tests read the caught fault's reports (tests/harness/runner/CMakeLists.txt,
# section 7), so its run is their fixture.
set_tests_properties(runner.fault.amax_not_reduced PROPERTIES FIXTURES_SETUP run_fault_amax)

if(PYTHON)
  # Every claimed pair has a scenario in check_fault_claims.py and every scenario there is claimed.
  add_test(runner.fault_claims_covered "${PYTHON}" "${RUNNER_DIR}/check_fault_claims.py" coverage
           "${MESHPROOF}" ${claims})
  set_tests_properties(runner.fault_claims_covered PROPERTIES LABELS cpu)
endif()
